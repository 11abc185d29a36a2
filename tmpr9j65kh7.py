print(15 * 2)
