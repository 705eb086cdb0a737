"""`reduce_metrics`: per-rank metric dicts → one dict (a lone dict is what a one-rank group returns uncopied)."""

from hybridflow.trainer.metrics import reduce_metrics


def test_averages_each_key_over_the_ranks_that_report_it():
    out = reduce_metrics([{"a": 1.0, "b": 4.0}, {"a": 3.0}])
    assert out == {"a": 2.0, "b": 4.0}


def test_single_rank_dict_is_accepted_as_is():
    assert reduce_metrics({"timing/switch": 0.25, "timing/generate": 1.5}) == {"timing/generate": 1.5,
                                                                              "timing/switch": 0.25}
