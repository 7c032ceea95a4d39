import pytest

from client.evaluation import exact_match, normalize_answer, vqa_accuracy
from client.inference.answers import first_answer_span


@pytest.mark.parametrize(
    ("text", "normalized"),
    [
        ("The Cat.", "cat"),
        ("Two dogs!", "2 dogs"),
        ("an apple", "apple"),
        ("it's 1.5 meters", "its 1.5 meters"),
        ("  Red,   blue ", "red blue"),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_first_answer_span_cuts_at_line_or_sentence_end():
    assert first_answer_span(" red circle.\nQuestion: next") == "red circle"
    assert first_answer_span("3.5 apples. Then") == "3.5 apples"


def test_vqa_accuracy_with_ten_humans_is_min_of_matches_over_three():
    humans = ["yes"] * 2 + ["no"] * 8
    # Each leave-one-out subset of 9 holds 2 "yes" (8 subsets) or 1 "yes" (2 subsets).
    expected = (8 * (2 / 3) + 2 * (1 / 3)) / 10
    assert vqa_accuracy("Yes", humans) == pytest.approx(expected)
    assert vqa_accuracy("no", humans) == pytest.approx(1.0)
    assert vqa_accuracy("maybe", humans) == 0.0


def test_single_reference_is_normalised_exact_match():
    assert vqa_accuracy("The square", ["square"]) == 1.0
    assert exact_match("Square.", "square") == 1.0
    assert exact_match("circle", "square") == 0.0


def test_vqa_accuracy_needs_a_reference():
    with pytest.raises(ValueError, match="at least one"):
        vqa_accuracy("x", [])
