print(18 * 2)
