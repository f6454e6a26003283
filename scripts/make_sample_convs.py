"""Regenerate layertap/data_files/sample_convs.jsonl: conversations cut from the Python standard
library's source (deterministic), so the bundled sample needs no download and a target trained on the
same text has something real to predict. Usage: python scripts/make_sample_convs.py"""
import json
import random
import sysconfig
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "layertap" / "data_files" / "sample_convs.jsonl"
ASKS = ["Continue this Python code:", "What comes next in this file?", "Complete the code:",
        "Write the next lines:"]


def main(n: int = 256, seed: int = 0) -> None:
    rng = random.Random(seed)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rows = []
    while len(rows) < n:
        lines = [l for l in rng.choice(files).read_text(errors="replace").splitlines() if l.strip()]
        if len(lines) < 30:
            continue
        a = rng.randrange(0, len(lines) - 25)
        k, m = rng.randint(2, 10), rng.randint(2, 14)  # very different lengths on purpose
        user = rng.choice(ASKS) + "\n" + "\n".join(lines[a:a + k])
        reply = "\n".join(lines[a + k:a + k + m])
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        if rng.random() < 0.25:  # some multi-turn conversations
            b = a + k + m
            msgs += [{"role": "user", "content": "And then?"},
                     {"role": "assistant", "content": "\n".join(lines[b:b + rng.randint(2, 6)])}]
        rows.append({"messages": msgs})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} conversations to {OUT}")


if __name__ == "__main__":
    main()
