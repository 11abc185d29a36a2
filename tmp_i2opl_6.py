print(0 * 2)
