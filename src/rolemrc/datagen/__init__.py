"""rolemrc.datagen"""
