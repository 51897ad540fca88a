"""Views over devices, runs and jobs: tables, live dashboards and the comparison of runs (ipywidgets + bokeh)."""
