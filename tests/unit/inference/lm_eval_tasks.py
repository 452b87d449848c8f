"""Local lm-evaluation-harness tasks for the tests: a log-likelihood task read from JSON lines."""

import json
import textwrap

PASSAGES = ["The tower was built of local granite", "A keeper lived in the small cottage",
            "The storm damaged the lantern room twice", "Visitors climb the spiral staircase",
            "The light can be seen from far away", "The trust restored the old tower"]


def write_loglikelihood_task(folder, name: str, rows) -> None:
    """``folder/name.yaml``: ``{"context", "target"}`` rows scored for perplexity and accuracy (the data in
    ``folder/name.jsonl``)."""
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(textwrap.dedent(f"""\
        task: {name}
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {folder / f'{name}.jsonl'}
        test_split: test
        output_type: loglikelihood
        doc_to_text: "{{{{context}}}}"
        doc_to_target: "{{{{target}}}}"
        metric_list:
          - metric: perplexity
            aggregation: perplexity
            higher_is_better: false
          - metric: acc
            aggregation: mean
            higher_is_better: true
        """))
