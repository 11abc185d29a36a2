print(16 * 2)
