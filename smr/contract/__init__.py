"""The message contract: the JSON Schemas every message is checked against
(schemas.py over schemas/), the typed messages (messages.py) and the
errors every layer raises (errors.py). The bottom of smr: it imports
nothing else of smr."""
