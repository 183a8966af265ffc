"""rolemrc.intervene"""
