"""rolemrc.train"""
