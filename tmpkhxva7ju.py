print(7 * 2)
