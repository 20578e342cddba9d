"""Operator tools: the local stack and the rebuild of Redis from the topics."""
