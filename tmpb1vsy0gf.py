print(11 * 2)
