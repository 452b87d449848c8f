"""docs/flags.md, generated from the parser and the flag table: ``python -m megatron.training.flag_docs``.

A unit test compares the file with ``render()``, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import sys
from typing import List

from megatron.training import flag_table as ft
from megatron.training.megatron_flags import MEGATRON_FLAGS

HEADER = """# Command-line flags

Generated from the parser (`megatron/training/parser.py`) and the flag table (`megatron/training/flag_table.py`)
by `python -m megatron.training.flag_docs > docs/flags.md`; a unit test checks that this file matches them.

Every flag Megatron-LM's `arguments.py` has defined since 2020 falls in exactly one class:

1. **implemented**: same name, meaning and default as Megatron-LM (differences are listed below);
2. **translated**: an older spelling, rewritten to today's with a one-line note on rank 0;
3. **accepted without effect**: dropped with a one-line note on rank 0 saying why;
4. **refused**: the run stops with one line naming the flag, the feature and what to use instead.

A flag that is not Megatron-LM's gets the usual `unrecognized arguments` error with the closest known names.
Configuration errors print one line on stderr (rank 0 only under `torchrun`) and exit with status 2.
"""


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _default(action: argparse.Action) -> str:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off"
    if action.default is None:
        return ""
    if isinstance(action.default, list):
        return " ".join(map(str, action.default))
    return str(action.default)


def implemented_actions(parser: argparse.ArgumentParser):
    """(group title, action) for every documented flag of ``parser``."""
    for group in parser._action_groups:
        for action in group._group_actions:
            if action.help == argparse.SUPPRESS or not action.option_strings:
                continue
            if "--help" in action.option_strings:
                continue
            yield group.title, action


def render() -> str:
    from megatron.training.arguments import CHECKPOINT_ARGS, make_parser

    parser = make_parser()
    implemented = set(parser.known_flags())
    out: List[str] = [HEADER, "## Implemented\n"]
    title = None
    for group, action in implemented_actions(parser):
        if group != title:
            title = group
            out.append(f"\n### {group}\n\n| flag | default | help |\n| --- | --- | --- |")
        flag = action.option_strings[0]
        default = _default(action)
        if action.dest in CHECKPOINT_ARGS and CHECKPOINT_ARGS[action.dest] is not None:
            default = str(CHECKPOINT_ARGS[action.dest])
        help_text = action.help
        if action.choices:
            help_text += f" (choices: {', '.join(map(str, action.choices))})"
        if flag in ft.DEFAULT_DIFFERENCES:
            help_text += f". Differs from Megatron-LM: {ft.DEFAULT_DIFFERENCES[flag]}"
        out.append(f"| `{flag}` | {_cell(default)} | {_cell(help_text)} |")

    out.append("\n## Translated\n\n| flag | becomes |\n| --- | --- |")
    for flag, tr in sorted(ft.TRANSLATED_FLAGS.items()):
        value = " VALUE" if tr.takes_value else ""
        out.append(f"| `{flag}{value}` | {_cell(tr.modern)} |")

    out.append("\n## Accepted without effect\n\n| flag | why |\n| --- | --- |")
    for flag, (takes, why) in sorted(ft.NO_EFFECT_FLAGS.items()):
        out.append(f"| `{flag}{' VALUE' if takes else ''}` | {_cell(why)} |")

    out.append("\n## Refused\n\n| flag | feature | use instead |\n| --- | --- | --- |")
    for flag, (feature, advice) in sorted(ft.REFUSED_FLAGS.items()):
        out.append(f"| `{flag}` | {_cell(feature)} | {_cell(advice)} |")
    out.append("\nWhole features, by the flags' leading words:\n\n| flags starting with | feature | use instead |\n"
               "| --- | --- | --- |")
    for prefixes, feature, advice in ft.REFUSED_GROUPS:
        out.append(f"| {', '.join(f'`{p}`' for p in prefixes)} | {_cell(feature)} | {_cell(advice)} |")
    feature, advice = ft.REFUSED_OTHER
    out.append(f"\nAny other Megatron-LM flag: {feature}; use {advice}.")

    out.append("\n## Every Megatron-LM flag by class\n")
    for cls in (ft.IMPLEMENTED, ft.TRANSLATED, ft.NO_EFFECT, ft.REFUSED):
        names = [f for f in sorted(MEGATRON_FLAGS, key=str.lower) if ft.classify(f, implemented) == cls]
        out.append(f"**{cls}** ({len(names)}): " + ", ".join(f"`{n}`" for n in names) + "\n")
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
