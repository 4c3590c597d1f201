"""The comparison every attention test makes against the dense reference: the output, then the
gradients of q, k, v and the sinks (a gradient the reference has not, None, must be None too)."""
import numpy as np


def assert_matches_reference(out, grads, ref_out, ref_grads, fwd_tol: dict, grad_tol: dict):
    np.testing.assert_allclose(out, ref_out, **fwd_tol, err_msg="output")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        if r is None:
            assert g is None
            continue
        np.testing.assert_allclose(g, r, **grad_tol, err_msg=name)
