"""The OpenAI-compatible server: engines, its model catalog (models and restraints), restraints per request, A/B arm
assignment and the request log. It scores nothing: `rolemrc.ab` reports on an experiment from that log."""
