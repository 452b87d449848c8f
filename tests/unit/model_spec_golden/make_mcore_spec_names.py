"""Record where each ``ModelSpec`` field lives in Megatron-Core and its default there, from Megatron-Core's own code.

Runs only in a separate virtual environment that has Megatron-Core (never imported by the project)::

    OMP_NUM_THREADS=1 /work/venv-mcore/bin/python tests/unit/model_spec_golden/make_mcore_spec_names.py \
        tests/unit/model_spec_golden/mcore_spec_names.json

For every field name of ``megatron/core/model_spec.py`` (read from the file's text, so the project is not
imported): ``"TransformerConfig"`` with its dataclass default, or ``"GPTModel"`` with the default of that
``GPTModel.__init__`` argument, or ``null`` when Megatron-Core holds the fact under another name or elsewhere.
"""

import ast
import dataclasses
import inspect
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "..", "..", "..", "megatron", "core", "model_spec.py")


def spec_fields():
    tree = ast.parse(open(SPEC).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ModelSpec")
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]


def main(out: str) -> None:
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.abspath(os.path.join(HERE, "..", "..", ".."))
                and "work/main" not in p]
    import megatron.core
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}
    gpt = {k: p.default for k, p in inspect.signature(GPTModel.__init__).parameters.items()}
    rows = {}
    for name in spec_fields():
        if name in tc:
            rows[name] = {"where": "TransformerConfig", "default": tc[name]}
        elif name in gpt:
            rows[name] = {"where": "GPTModel", "default": gpt[name]}
        else:
            rows[name] = None
    with open(out, "w") as f:
        json.dump({"megatron_core": megatron.core.__version__, "fields": rows}, f, indent=1, default=str)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
