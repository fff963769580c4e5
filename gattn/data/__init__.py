"""Data: the embedded corpus (or a user's folder), a local tokenizer, a TFDS ArrayRecord dataset and
the Grain pipeline that packs it into training batches; pretokenized shards made on Apache Beam
(prepare.py, shards.py) and TFDS datasets by name. Knows tokens and batches, never the model."""
