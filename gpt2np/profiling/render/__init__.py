"""The profiler's tables, views and reports, from recorded kernel times."""
