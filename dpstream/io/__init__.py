"""Kafka edges of dpstream: the embedded demo broker and topic helpers."""
