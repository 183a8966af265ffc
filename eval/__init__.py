"""rolemrc.eval"""
