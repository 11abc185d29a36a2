print(14 * 2)
