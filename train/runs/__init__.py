"""The run wing: a run folder from claim to prune. ``folder`` (names, the marker, identity and lineage, claiming and
releasing), ``lock``, ``plan`` (fresh, resume, branch or fine-tune: what a start does), ``start`` (the plan made and
the folder claimed for the Trainer), ``resume`` (what may change on a resume), ``checkpoint`` (atomic save, keep-last-K
and best, weights-only loading), ``metrics`` (records, provenance, curves), ``report`` (the end-of-run summary and the
next commands), ``signals``.
"""
