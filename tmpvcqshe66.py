print(9 * 2)
