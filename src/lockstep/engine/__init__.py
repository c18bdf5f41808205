"""The data-parallel engines: the textbook `NaiveDataParallel` and the bucketed one."""
