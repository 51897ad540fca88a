"""How a live dashboard reaches the page: the widget that keeps a page's view in step with the plots (and
catches up, once, a view that missed the first pushes), the frame it shows in, and the static copy that frame
turns into when the dashboard closes.

The frame (``LiveFrame``) is an ``Output`` widget holding BokehJS and then the dashboard: its outputs render in
order, so BokehJS is defined before any plot's view is built, on a page reloaded or a notebook run again
whatever order the page builds widgets in; the notebook file keeps a reference to the frame, not 2 MB of
JavaScript per dashboard. A finished dashboard freezes its frame into a static copy of its last picture. Once
per kernel BokehJS is also plain output, for static copies in a notebook reopened after its kernel ended.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

# Patches sent before the browser has built the widget's view are dropped by BokehJS: a full re-send of the
# plots this long after a live dashboard's widget is made catches up a view that missed its first updates.
FIRST_REFRESH_S = 2.0
# text in JupyterLab's own colours: at least 4.5:1 on its light and dark themes alike
TEXT = "color:var(--jp-content-font-color1)"
ERROR = "color:var(--jp-error-color1)"


def unsynced(model: Any) -> Any:
    """Mark ``model`` and what it refers to as never sent back by the browser (no events for the kernel);
    for models added to a live dashboard after it is shown."""
    for part in model.references():
        if part.syncable:  # a set is a property change, notified: only where it changes
            part.syncable = False
    return model


def quiet(layout: Any) -> Any:
    """Mark ``layout`` as a gpumagic view: the page sends the kernel none of its changes (QUIET_JS: a stream, a
    selection, a moved slider stay in the browser) and its models are ``unsynced``."""
    if "gpumagic" not in layout.tags:
        layout.tags = [*layout.tags, "gpumagic"]
    return unsynced(layout)


def close_tree(widget: Any) -> None:
    """Close an ipywidget and everything it holds: its children, and the layouts and styles ``close()`` leaves
    open (widgets too)."""
    if widget is None:
        return
    for child in getattr(widget, "children", ()):
        close_tree(child)
    for part in (getattr(widget, "style", None), getattr(widget, "layout", None)):
        if part is not None and getattr(part, "comm", None) is not None:
            part.close()
    if getattr(widget, "comm", None) is not None:
        widget.close()


def live_model(layout: Any, lock: threading.RLock) -> Any:
    """The widget showing ``layout``, kept in step with it: whatever changes ``layout`` must hold ``lock``."""
    return _live_model_class()(layout, lock)


@functools.cache
def _live_model_class() -> type:
    # lazy: bokeh and jupyter_bokeh are heavy, for views only
    from bokeh.core.json_encoder import serialize_json
    from jupyter_bokeh.widgets import BokehModel

    class LiveBokehModel(BokehModel):
        """A BokehModel whose full state is the plots as they are now, not as they were created: a page that
        connects later (a reload, a reopened notebook) draws the history, with no periodic re-send. Patches and
        this widget's own state messages are sent under the dashboard's lock, so the several messages of one
        patch are never interleaved with another's, and the plots are never read while they change. (A page
        that asks for every widget's state at once gets it on ipywidgets' control channel, sent after the lock
        is released: a push made meanwhile reaches that page before its view exists, a gap of one push.)"""

        def __init__(self, layout: Any, lock: threading.RLock) -> None:
            self._plots_lock = lock
            self._made = time.monotonic()
            self.refreshes = 0  # the plots sent whole since (one catch-up at most)
            quiet(layout)
            super().__init__(layout)

        def get_state(self, key: Any = None, drop_defaults: bool = False) -> dict[str, Any]:
            state = super().get_state(key, drop_defaults)
            if "render_bundle" in state:
                with self._plots_lock:
                    state["render_bundle"] = serialize_json(self._model_to_traits(self._model))
            return state

        def send_state(self, key: Any = None) -> None:
            with self._plots_lock:
                super().send_state(key)

        def catch_up(self) -> None:
            """Send the plots whole to the pages showing them (a view built after the first patches)."""
            self.send_state("render_bundle")

        def catch_up_once(self) -> bool:
            """``catch_up`` once, ``FIRST_REFRESH_S`` after this widget was made (the dashboard's thread calls it
            at each push): a view built after the first pushes missed them; later, patches keep it in step and a
            page that reloads gets the plots whole anyway. Whether it sent them now."""
            if self.refreshes or time.monotonic() - self._made < FIRST_REFRESH_S:
                return False
            self.catch_up()
            self.refreshes += 1
            return True

        def _document_patched(self, event: Any) -> None:
            with self._plots_lock:
                super()._document_patched(event)

        def _sync_model(self, model: Any, content: dict[str, Any], buffers: list[Any]) -> None:
            """Changes made in the browser never come back: the kernel's plots are the only truth (a browser
            that changed a source, as the forward-only guard does, would otherwise overwrite the kernel's
            copy when the kernel next reads its messages)."""

    return LiveBokehModel


def bokehjs_loader() -> Any:
    """The hidden widget carrying BokehJS (this kernel's one): displayed before a dashboard, it defines
    ``window.Bokeh`` on a page that lacks this version, and does nothing on a page that has it."""
    global _loader
    if _loader is None or _loader.comm is None:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        loader = ipywidgets.Output(layout=ipywidgets.Layout(display="none"))
        loader.add_class("gpumagic-bokehjs")
        loader.outputs = (
            {"output_type": "display_data", "data": {"application/javascript": bokehjs_source()}, "metadata": {}},
        )
        _loader = loader
    return _loader


_loader: Any = None


@functools.cache
def bokehjs_source() -> str:
    """BokehJS (its core bundle: plots, hover, tabs), run only where ``window.Bokeh`` is not this version, then
    its widgets and tables bundles (the smoothing slider; the comparison's table), once per page."""
    # lazy: bokeh is heavy, for views only
    import bokeh
    from bokeh.resources import Resources

    core = "\n".join(Resources(mode="inline", components=["bokeh"]).js_raw)
    extensions = "\n".join(Resources(mode="inline", components=["bokeh-widgets", "bokeh-tables"]).js_raw)
    version = json.dumps(bokeh.__version__)
    # called with window as `this`: the bundle hands `this` to its loader as the global object
    return (
        f"if (!(window.Bokeh && window.Bokeh[{version}])) {{ (function () {{\n{core}\n}}).call(window); }}\n"
        f"(function () {{ const b = window.Bokeh && window.Bokeh[{version}];"
        f" if (!b || b.gpumagicExtensions) return; b.gpumagicExtensions = true;\n"
        f"(function () {{\n{extensions}\n}}).call(window); }})();\n{QUIET_JS}"
    )


# jupyter_bokeh's view sends the kernel every change of its document, those the kernel made included (each
# stream comes back with its points), whatever the models' syncable. The kernel's copy of a dashboard is the
# only truth (LiveBokehModel drops them all), so on a document that shows a gpumagic dashboard (a root tagged
# "gpumagic") the view's listener is not registered: moving the slider, zooming or a stream sends nothing.
QUIET_JS = """
(function () {
  const Bokeh = window.Bokeh;
  if (!Bokeh || Bokeh.gpumagicQuiet) return;
  Bokeh.gpumagicQuiet = true;
  const { Document } = Bokeh.require("document");
  const on_change = Document.prototype.on_change;
  Document.prototype.on_change = function (callback, allow_batches) {
    const ours = this.roots().some((root) => (root.tags || []).includes("gpumagic"));
    if (ours && String(callback).includes("_change_event")) return;
    return on_change.call(this, callback, allow_batches);
  };
})();
"""


_inline_shown = False
KEPT_FRAMES = 8  # frozen frames kept alive for pages reloaded before they saw the freeze: the latest ones


def _widget_view(widget: Any, text: str = "") -> dict[str, Any]:
    """An output showing ``widget`` (``text``: what a viewer without widgets shows)."""
    view = {"version_major": 2, "version_minor": 0, "model_id": widget.model_id}
    return {
        "output_type": "display_data",
        "data": {"application/vnd.jupyter.widget-view+json": view, "text/plain": text or "live dashboard"},
        "metadata": {},
    }


class LiveFrame:
    """Where a live dashboard shows: an ``Output`` widget holding BokehJS, then the dashboard's widget. Its
    outputs render in order and JavaScript runs as it renders, so ``window.Bokeh`` exists before any plot's
    view is built, on a page opened now or reloaded later, whatever order the page builds widgets in. A page
    reloaded while the kernel is free draws the frame as it is now (the live dashboard, from the run's present
    state); ``freeze`` turns it into a static copy (its last picture), in every page showing it and in the
    notebook file. Frozen frames stay alive (the latest ``KEPT_FRAMES``) for pages that reload later."""

    def __init__(self, widget: Any, text: str = "") -> None:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        self.frame = ipywidgets.Output()
        self.frame.add_class("gpumagic-frame")
        script = {"output_type": "display_data", "data": {"application/javascript": bokehjs_source()}, "metadata": {}}
        self.frame.outputs = (script, _widget_view(widget, text))
        self.text = text
        self.handle: Any = None
        self.frozen = False

    def show(self) -> None:
        """Display the frame (in a kernel: the first time in this kernel, BokehJS as plain output before it)."""
        # lazy: IPython display, in a kernel only
        from IPython.display import display

        global _inline_shown
        if not _inline_shown:
            display({"application/javascript": bokehjs_source()}, raw=True)
            _inline_shown = True
        bundle = {**self.frame._repr_mimebundle_(), "text/plain": self.text or "live dashboard"}
        self.handle = display(bundle, raw=True, display_id=True)

    def freeze(self, html: str) -> None:
        """Show ``html`` (a static copy, BokehJS's embed scripts included) in place of the live widget: in the
        frame, for pages that show it or reload later, and as the display's plain HTML, which a notebook saved
        from now keeps after its kernel has ended."""
        if self.handle is not None:  # first: a page showing the frame now shows the copy once, not twice
            self.handle.update({"text/html": html}, raw=True)
        html_output = {"output_type": "display_data", "data": {"text/html": html}, "metadata": {}}
        self.frame.outputs = (_widget_view(bokehjs_loader()), html_output)
        if not self.frozen:
            self.frozen = True
            _frozen_frames.append(self)
            while len(_frozen_frames) > KEPT_FRAMES:
                close_tree(_frozen_frames.popleft().frame)


_frozen_frames: deque[LiveFrame] = deque()


def embedded(layout: Any, lock: threading.RLock) -> str:
    """``layout``'s plots as they are now, as HTML that BokehJS draws with no kernel (a static copy's plots)."""
    # lazy: bokeh is heavy, for views only
    from bokeh.embed import components

    with lock:
        script, div = components(layout)
    return div + script


def freeze_frames(frames: Sequence[LiveFrame], layout: Any, snapshot: str) -> None:
    """Put ``snapshot`` (HTML) in ``frames``, where a dashboard was shown, once its widgets are closed, and free
    the live document of ``layout`` (the copy's models are the same ones)."""
    if not frames or sys.is_finalizing():
        return
    if layout is not None and layout.document is not None:
        layout.document.remove_root(layout)
    for frame in frames:
        frame.freeze(snapshot)


class Frames:
    """Where a live view (``%gpu watch``, ``%jobs watch``) is shown: a ``LiveFrame`` per display, which all turn
    into its static copy when it closes."""

    def __init__(self, text: str) -> None:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        self.text = text  # what a viewer without widgets shows
        self.shown: list[LiveFrame] = []
        self._close_widget = ipywidgets.DOMWidget.close  # bound now: closing may run late in shutdown

    def show(self, widget: Any) -> None:
        """Display ``widget`` in a new frame."""
        frame = LiveFrame(widget, text=self.text)
        frame.show()
        self.shown.append(frame)

    def freeze(self, static_html: str, widget: Any, plots: Any, layout: Any, lock: threading.RLock) -> str:
        """Close the view's ``widget`` (``plots``, its ``live_model``, included) and put its static copy in the
        frames: ``static_html``, then the plots of ``layout`` as they are now (where it was shown). Returns the
        copy."""
        snapshot = static_html + (embedded(layout, lock) if self.shown else "")
        # DOMWidget.close, not BokehModel.close: jupyter_bokeh's close unhooks the document and raises when
        # ipywidgets' __del__ calls it a second time; leaving that to __del__ makes it happen exactly once.
        self._close_widget(plots)
        close_tree(widget)  # the buttons, texts and tables, with their layouts and styles
        freeze_frames(self.shown, layout, snapshot)
        return snapshot


def owned_box(children: list[Any], owner: Any) -> Any:
    """A VBox of ``children`` whose ``close()`` also closes ``owner``, the live view it shows."""
    return _owned_box_class()(children, owner)


@functools.cache
def _owned_box_class() -> type:
    # lazy: ipywidgets is heavy, for views only
    import ipywidgets

    class OwnedBox(ipywidgets.VBox):
        """A VBox whose ``close()`` also closes the view that owns it."""

        def __init__(self, children: list[Any], owner: Any) -> None:
            super().__init__(children)
            self._owner = owner

        def close(self) -> None:
            owner, self._owner = getattr(self, "_owner", None), None
            if owner is not None and not sys.is_finalizing():
                owner.close()
            super().close()

    return OwnedBox
