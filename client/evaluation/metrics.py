"""Answer scoring as the MTV evaluation does it (notes/mtv.md §6(e)), written for dpmtv.

* :func:`vqa_accuracy` is the standard VQA accuracy: min(1, #humans who gave the answer / 3),
  averaged over the leave-one-out subsets of the human answers, after normalisation
  (lower case, punctuation, articles, number words). With a single reference answer it is
  normalised exact match.
* :func:`exact_match` compares normalised strings (classification labels).
* Generated text is cut before scoring (``client.inference.answers.first_answer_span``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import combinations

__all__ = ["exact_match", "normalize_answer", "vqa_accuracy"]

_NUMBER_WORDS = {
    "none": "0",
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "ten": "10",
}
_ARTICLES = {"a", "an", "the"}
# A period between digits is a decimal point, not punctuation ("1.5").
_PUNCTUATION = re.compile(r"(?!(?<=\d)\.(?=\d))[^\w\s']")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and articles, spell numbers as digits, squeeze spaces."""
    lowered = _PUNCTUATION.sub(" ", text.lower().replace("'", ""))
    words = [_NUMBER_WORDS.get(word, word) for word in lowered.split()]
    return " ".join(word for word in words if word not in _ARTICLES)


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when the normalised prediction equals the normalised reference, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(reference))


def vqa_accuracy(prediction: str, references: Sequence[str]) -> float:
    """Standard VQA accuracy of one prediction against the human answers."""
    if not references:
        raise ValueError("references must hold at least one answer, got [].")
    predicted = normalize_answer(prediction)
    humans = [normalize_answer(answer) for answer in references]
    if len(humans) == 1:
        return float(predicted == humans[0])
    subsets = list(combinations(range(len(humans)), len(humans) - 1))
    scores = [min(1.0, sum(humans[i] == predicted for i in subset) / 3.0) for subset in subsets]
    return sum(scores) / len(scores)
