"""Validates CloudEvents (one JSON document per line on stdin) against the CloudEvents 1.0 JSON
schema beside this file, with the `date-time`, `uri` and `uri-reference` formats checked (their
checkers must be installed: a missing one would make jsonschema skip the format silently).
Exit 0 and prints the number of valid events; else prints each error and exits 1."""
import json
import pathlib
import sys

import jsonschema
import rfc3339_validator  # noqa: F401  (jsonschema's date-time checker)
import rfc3986_validator  # noqa: F401  (jsonschema's uri / uri-reference checker)

schema = json.loads((pathlib.Path(__file__).parent / "cloudevents-1.0.schema.json").read_text())
validator = jsonschema.Draft7Validator(schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
for fmt in ("date-time", "uri", "uri-reference"):
    if fmt not in validator.format_checker.checkers:
        sys.exit(f"format {fmt} cannot be checked")
errors, n = [], 0
for line in sys.stdin:
    if not line.strip():
        continue
    n += 1
    for e in validator.iter_errors(json.loads(line)):
        errors.append(f"event {n}: {e.message} at {list(e.path)}")
if errors:
    print("\n".join(errors))
    sys.exit(1)
print(n)
