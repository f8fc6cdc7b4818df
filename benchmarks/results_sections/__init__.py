"""The sections of ``docs/RESULTS.md``, by topic, and the framework they are built with (``framework.py``);
``benchmarks/results_page.py`` lists them in page order and writes the page."""
