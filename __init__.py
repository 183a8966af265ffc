"""rolemrc: RoleMRC end to end, from data synthesis to probing, restraint and serving."""

__version__ = "0.1.0"
