"""The worker: raw records in, Tokens, billing events, chunks and dead letters out.

- `app` builds the faust app (`create_app`); `loop` is its batch loop, a stage per
  method (`BatchLoop`: fetch, decode, apply, write, commit); `source` reads the raw
  topics, `sinks` writes the outputs, `writes` and `commits` decide what is committed
  and when, `stages` and `metrics` measure it.
- `requests` is the processing logic free of Kafka and Redis (`RequestProcessor`), a
  facade over its parts: `table` (the open requests), `refusals` (edge, limits, dead
  letters), `sequencing` (each record in its place), `folding` (a request's next
  record folded) and `closing` (the close and the bill).
"""
