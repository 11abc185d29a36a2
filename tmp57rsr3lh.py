print(13 * 2)
