"""How a live dashboard reaches the page: the widget that keeps a page's view in step with the plots (and
catches up, once, a view that missed the first pushes), the frame it shows in, and the static copy that frame
turns into when the dashboard closes.

The frame (``LiveFrame``) is an ``Output`` widget holding BokehJS and then the dashboard: its outputs render in
order, so BokehJS is defined before any plot's view is built, on a page reloaded or a notebook run again
whatever order the page builds widgets in; the notebook file keeps a reference to the frame, not 2 MB of
JavaScript per dashboard. A finished dashboard freezes its frame into a static copy of its last picture. Once
per kernel BokehJS is also plain output, for static copies in a notebook reopened after its kernel ended.

Where the rich view cannot draw, a still picture (``widgets.picture``, SVG drawn in the kernel) stands in, kept
up to date at most once a second until the page says its Bokeh view drew (FRAME_JS; a blocking cell hears it
only when it ends, so it draws the picture all along): in the frame, under the status line, shown where the
Bokeh view fails (a JupyterHub whose server lacks jupyter_bokeh's front end); and in a plain HTML output after
the frame, for a front end that shows no widgets at all (hidden by FRAME_JS wherever the frame renders). Every
static copy keeps the picture too, shown where no script runs.
"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from gpumagic.widgets.picture import picture_of

log = logging.getLogger(__name__)

# Patches sent before the browser has built the widget's view are dropped by BokehJS: a full re-send of the
# plots this long after a live dashboard's widget is made catches up a view that missed its first updates.
FIRST_REFRESH_S = 2.0
# text in JupyterLab's own colours: at least 4.5:1 on its light and dark themes alike
TEXT = "color:var(--jp-content-font-color1)"
ERROR = "color:var(--jp-error-color1)"
STILL_EVERY_S = 1.0  # a still picture standing in for a live view is redrawn at most this often
INSTALL_HINT = (
    "the live plots need the jupyter_bokeh extension in the Jupyter server's environment "
    "(pip install jupyter_bokeh there, then reload the page); meanwhile a picture, updated every second"
)
STILL_HINT = (
    "the interactive plots need the jupyter_bokeh extension in the Jupyter server's environment "
    "(pip install jupyter_bokeh there, then reload the page); meanwhile a picture"
)


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
            self.changes = 0  # the document's changes so far: a still picture is redrawn only after one
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
                self.changes += 1
                super()._document_patched(event)

        @property
        def layout_shown(self) -> Any:
            """The Bokeh layout this widget shows."""
            return self._model

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


# Run in the page with each frame (``element``: its output): once the frame's Bokeh view is drawn it tells the
# kernel "rich" (the kernel stops redrawing the still picture); where the view failed (no jupyter_bokeh in the
# front end: ipywidgets' error box) it tells "plain", hides the error box and shows the still picture instead.
# The picture is hidden only where this script runs: a page that runs no script shows it.
FRAME_JS = """
(function (element) {
  const node = element && element.jquery ? element[0] : element;
  if (!node) return;
  const token = "TOKEN";  // this frame's: the plain copy of it is not needed where the frame renders
  const plain = document.createElement("style");
  plain.textContent = `.gpumagic-plain-copy-${token}, .jp-OutputArea-child:has(.gpumagic-plain-copy-${token}),`
    + ` .output_area:has(.gpumagic-plain-copy-${token}) { display: none !important; }`;
  document.head.appendChild(plain);
  if (!document.getElementById("gpumagic-frame-css")) {
    const style = document.createElement("style");
    style.id = "gpumagic-frame-css";
    style.textContent = ".gpumagic-frame:not(.gpumagic-plain) .gpumagic-still-view { display: none !important; }\\n"
      + ".gpumagic-frame.gpumagic-plain .jupyter-widgets-error-widget { display: none !important; }";
    document.head.appendChild(style);
  }
  const started = Date.now();
  let frame = null, word = "", told = "", pictured = 0;
  const tell = () => {
    const input = frame.querySelector(".gpumagic-answer textarea");
    if (!input) return false;
    input.value = word;
    input.dispatchEvent(new Event("input", {bubbles: true}));
    return true;
  };
  const look = () => {
    frame = frame || (node.closest ? node.closest(".gpumagic-frame") : null);
    if (frame && !word) {
      if (frame.querySelector(".jupyter-widgets-error-widget")) word = "plain";
      else if (frame.querySelector('[class^="bk-"], [class*=" bk-"]')) word = "rich";
      else if ((frame.querySelector(".gpumagic-still-view svg"))) {
        pictured = pictured || Date.now();  // a picture to show and still no view of the plots: say plain
        if (Date.now() - pictured > 5000) word = "plain";
      }
      if (word === "plain") frame.classList.add("gpumagic-plain");
    }
    if (word && told !== word && tell()) told = word;
    if (told && told === word) return;
    if (Date.now() - started < 600000) setTimeout(look, 250);
  };
  look();
})(element);
"""


class LiveFrame:
    """Where a live dashboard shows: an ``Output`` widget holding BokehJS, then the dashboard's widget. Its
    outputs render in order and JavaScript runs as it renders, so ``window.Bokeh`` exists before any plot's
    view is built, on a page opened now or reloaded later, whatever order the page builds widgets in. A page
    reloaded while the kernel is free draws the frame as it is now (the live dashboard, from the run's present
    state); ``freeze`` turns it into a static copy (its last picture), in every page showing it and in the
    notebook file. Frozen frames stay alive (the latest ``KEPT_FRAMES``) for pages that reload later.

    ``plots`` (the view's ``live_model`` widget, None before it exists) and ``status`` (its status as HTML) let
    ``refresh`` keep a still picture of the plots where the rich view does not draw (see the module's doc): in
    the frame (``still``) and in a plain HTML output after it (``plain_copy``)."""

    def __init__(
        self,
        widget: Any,
        text: str = "",
        *,
        plots: Callable[[], Any] | None = None,
        status: Callable[[], str] | None = None,
    ) -> None:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        self.frame = ipywidgets.Output()
        self.frame.add_class("gpumagic-frame")
        self.still = ipywidgets.HTML()  # the picture standing in for the plots where they cannot draw
        self.still.add_class("gpumagic-still-view")
        # what the page says (FRAME_JS); a text area: no text input joins the page's for tools to trip over
        self.answer = ipywidgets.Textarea(layout=ipywidgets.Layout(display="none"))
        self.answer.add_class("gpumagic-answer")
        self.answer.observe(self._heard, names="value")
        script = {"output_type": "display_data", "data": {"application/javascript": bokehjs_source()}, "metadata": {}}
        self.token = secrets.token_hex(8)
        frame_js = {
            "output_type": "display_data",
            "data": {"application/javascript": FRAME_JS.replace("TOKEN", self.token)},
            "metadata": {},
        }
        self.frame.outputs = (
            script,
            frame_js,
            _widget_view(widget, text),
            _widget_view(self.still),
            _widget_view(self.answer),
        )
        self.text = text
        self.handle: Any = None
        self.plain_copy: Any = None  # the display of the plain HTML copy
        self.frozen = False
        self.heard = ""  # what the page said: "rich" (its Bokeh view drew) or "plain" (it could not)
        self.stills = 0  # still pictures drawn
        self._plots = plots
        self._status = status
        self._drawn: tuple[Any, ...] = ()
        self._drawn_at = -STILL_EVERY_S

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
        if self._status is not None:
            self.plain_copy = display(self._plain(self._status()), raw=True, display_id=True)

    def _plain(self, status: str, picture: str = "") -> dict[str, str]:
        """The plain copy's data: the view's status and its picture, for a front end that shows no widgets."""
        body = status + picture
        return {"text/html": f"<div class='gpumagic-plain-copy gpumagic-plain-copy-{self.token}'>{body}</div>"}

    def _heard(self, change: dict[str, Any]) -> None:
        self.heard = str(change["new"])
        if self.heard == "rich":
            self.still.value = ""  # the page draws the plots: no picture is sent any more

    def refresh(self) -> None:
        """Redraw the still picture where the rich view is not known to draw: at most once a ``STILL_EVERY_S``
        and only after the plots or the status changed (the view's thread calls it at each push). The frame's
        picture until the page says "rich"; the plain copy until the page says anything (widgets render)."""
        if self.frozen or self.heard == "rich" or self._plots is None or self.handle is None:
            return
        now = time.monotonic()
        if now - self._drawn_at < STILL_EVERY_S:
            return
        plots = self._plots()
        plain = self.plain_copy is not None and not self.heard
        status = self._status() if plain and self._status is not None else ""
        stamp = (getattr(plots, "changes", None), id(plots), status)
        if stamp == self._drawn:
            return
        self._drawn, self._drawn_at = stamp, now
        try:
            picture = picture_of(plots.layout_shown, plots._plots_lock) if plots is not None else ""
        except Exception:  # the live view goes on; the picture waits for the next change
            log.warning("gpumagic: the still picture of %s failed", self.text, exc_info=True)
            return
        self.stills += 1
        if picture:
            self._show_still(INSTALL_HINT, picture)
        if plain:
            self.plain_copy.update(self._plain(status, picture), raw=True)

    def draw_still(self, picture: str) -> None:
        """Put ``picture`` in the frame once, for a view that never changes (shown where its plots fail)."""
        if picture and not self.frozen:
            self._show_still(STILL_HINT, picture)

    def _show_still(self, hint: str, picture: str) -> None:
        """The frame's picture, under the line saying what to install where."""
        self.still.value = f"<div style='font-size:12px;{TEXT}'>{hint}</div>{picture}"

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
            if self.plain_copy is not None:  # the copy above says it all
                self.plain_copy.update({"text/html": ""}, raw=True)
            for part in (self.still, self.answer):
                close_tree(part)
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
    return still_beside(picture_of(layout, lock), div + script)


def still_beside(picture: str, interactive: str) -> str:
    """``interactive`` (BokehJS's embed) with ``picture`` (SVG) before it: where a script runs and BokehJS draws
    the copy, the picture is hidden; where none runs (an HTML export read with JavaScript off, a saved notebook
    on a site that runs no script), the picture is what shows."""
    if not picture:
        return interactive
    still_id = f"gpumagic-still-{secrets.token_hex(6)}"
    hide = (
        "<script>(function () { const still = document.getElementById(" + json.dumps(still_id) + ");"
        " if (!still) return; const copy = still.nextElementSibling; let tries = 0;"
        " const look = () => { if (copy && copy.querySelector('*')) { still.style.display = 'none'; return; }"
        " if (++tries < 600) setTimeout(look, 100); }; look(); })();</script>"
    )
    return f"<div class='gpumagic-still' id='{still_id}'>{picture}</div>{interactive}{hide}"


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

    def __init__(
        self, text: str, *, plots: Callable[[], Any] | None = None, status: Callable[[], str] | None = None
    ) -> None:
        # lazy: ipywidgets is heavy, for views only
        import ipywidgets

        self.text = text  # what a viewer without widgets shows
        self.shown: list[LiveFrame] = []
        self._plots = plots
        self._status = status
        self._close_widget = ipywidgets.DOMWidget.close  # bound now: closing may run late in shutdown

    def show(self, widget: Any) -> None:
        """Display ``widget`` in a new frame."""
        frame = LiveFrame(widget, text=self.text, plots=self._plots, status=self._status)
        frame.show()
        self.shown.append(frame)

    def refresh(self) -> None:
        """``LiveFrame.refresh`` in every frame showing the view."""
        for frame in list(self.shown):
            frame.refresh()

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
