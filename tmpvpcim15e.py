print(6 * 2)
