"""The wire: record types, their Avro encoding, and Kafka plumbing shared by every client."""
