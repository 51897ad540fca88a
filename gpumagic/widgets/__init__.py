"""Views over devices, telemetry and jobs: HTML/text tables now, ipywidgets + bokeh dashboards next."""
