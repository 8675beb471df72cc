"""The base both packages stand on: what the harness (``paasbench``) and the reference server
(``reference_server``) share, so neither has to import the other.

Exit codes and ``InputError`` (:mod:`.errors`), the one tokenizer loader (:mod:`.tokenizer`), child processes that
die with their parent (:mod:`.lifetime`), the one 64-bit hash mix (:mod:`.hashing`) and the one Prometheus text
parser (:mod:`.prometheus`). It imports neither side (tests/test_import_graph.py checks it).
"""
