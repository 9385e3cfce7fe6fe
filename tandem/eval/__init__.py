"""Accuracy evaluation: ``tandem eval`` (MMLU, ASDiv, GSM-Symbolic, lm-eval's formats and
metrics) and ``tandem eval-parity`` (scores and answers equal with every overlap feature on
and off).

Modules: ``data`` (where the data sets come from, offline), ``tasks`` (documents, prompts,
scoring), ``extraction`` (lm-eval's gsm8k answer filters), ``backends`` (offline engine or
OpenAI-compatible server), ``runner`` (scores, standard errors, table, JSON), ``parity``
(overlap variants on/off), ``cli``.
"""
