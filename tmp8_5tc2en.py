print(19 * 2)
