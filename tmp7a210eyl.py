print(12 * 2)
