"""The clients of the trackers ``gpumagic.track`` exports to, one module each; each imports its tracker's package
only when a run opens (``telemetry.exporting.Destination``)."""
