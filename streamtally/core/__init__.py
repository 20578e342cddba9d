"""The domain core: raw events to chunks to Tokens, and pricing. No I/O, no Kafka, no Redis."""
