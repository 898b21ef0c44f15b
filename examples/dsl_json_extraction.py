"""JSON extraction with a schema: `gen(json_schema=...)` makes the output parse and validate.

    make serve                                   # or: radixserve serve  (http://127.0.0.1:30000)
    python examples/dsl_json_extraction.py       # another terminal
    python examples/dsl_json_extraction.py --url http://host:8000 --api-key sk-...

The schema goes to the server's structured-output decoding (xgrammar), so every finished output is valid
JSON of that shape, whatever the model would have preferred to write.
"""

from __future__ import annotations

import argparse
import json

from radixserve.frontend import RuntimeEndpoint, assistant, function, gen, set_default_backend, system, user

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "maxLength": 40},
        "occupation": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city", "occupation"],
    "additionalProperties": False,
}
TEXTS = [
    "Maria Lopez, 34, moved to Lisbon last spring, where she now works as a marine biologist.",
    "At 61, retired firefighter Tom Becker spends his mornings gardening in his home town of Leeds.",
]


@function
def extract(s, text):
    s += system("You extract facts from text and answer with JSON only.")
    s += user("Extract the person's name, age, city and occupation from this text:\n" + text)
    s += assistant(gen("person", json_schema=PERSON_SCHEMA, max_tokens=80))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args(argv)
    set_default_backend(RuntimeEndpoint(args.url, api_key=args.api_key))

    for state in extract.run_batch([{"text": text} for text in TEXTS], temperature=0.0):
        if state.error is not None:
            raise state.error
        person = json.loads(state["person"])
        print(json.dumps(person, ensure_ascii=False))


if __name__ == "__main__":
    main()
