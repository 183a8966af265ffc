"""rolemrc.serve"""
