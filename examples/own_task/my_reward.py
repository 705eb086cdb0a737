def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 exact; otherwise the fraction of positions right."""
    got, want = solution_str.strip().split(), ground_truth.split()
    if got == want:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(got, want)) / len(want)
