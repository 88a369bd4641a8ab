"""Tools around the library: the launcher (run), the multi-rank test harness
(testing) and the environment check (doctor). They import without torch."""
