"""An interactive viewer: viser serves the page and the camera controls, our rasterizer draws every frame.

Each browser that connects reports its camera over viser's websocket (pose as camera-to-world with OpenCV axes,
vertical fov, canvas size). ``camera_matrices`` turns that into our viewmat and K at a resolution that fits
``size`` with the canvas's aspect; a render thread draws the newest pose of every client that moved and sends
it back as the scene's background image (JPEG). Poses that arrive while a frame renders are coalesced: a slow
(CPU) render lags the mouse but never queues a backlog.

    viewer = Viewer(splats, background=bg, home=orbit, size=(320, 240), device="cpu")
    url = viewer.start("127.0.0.1", 8080)
    ...
    viewer.stop()
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import threading
import time
from typing import Any

import numpy as np
import torch

from warpforge.splat.scene import Splats, render
from warpforge.splat.video import Orbit, _quat_to_rotmat


def frame_size(aspect: float, box: tuple[int, int]) -> tuple[int, int]:
    """The largest width x height with the canvas's aspect (width / height) that fits in ``box``."""
    bw, bh = box
    if not math.isfinite(aspect) or aspect <= 0:
        return bw, bh
    if aspect >= bw / bh:
        return bw, max(1, round(bw / aspect))
    return max(1, round(bh * aspect)), bh


def camera_matrices(wxyz, position, fov_y: float, width: int, height: int) -> tuple[torch.Tensor, torch.Tensor]:
    """viser's camera -> our viewmat [4, 4] (world -> camera) and K [3, 3] for a width x height image.

    viser's ``wxyz`` / ``position`` are R and t of ``P_world = R p_camera + t`` with OpenCV axes (x right, y down,
    z forward), the axes ``rasterize`` takes, so the viewmat is the inverse [R^T | -R^T t]. ``fov_y`` is the
    vertical field of view in radians; pixels are square, the principal point at the image centre."""
    r = _quat_to_rotmat(np.asarray(wxyz, dtype=np.float64))
    t = np.asarray(position, dtype=np.float64)
    view = np.eye(4)
    view[:3, :3], view[:3, 3] = r.T, -r.T @ t
    f = 0.5 * height / math.tan(0.5 * fov_y)
    k = np.array([[f, 0.0, width / 2.0], [0.0, f, height / 2.0], [0.0, 0.0, 1.0]])
    return torch.tensor(view, dtype=torch.float32), torch.tensor(k, dtype=torch.float32)


class Viewer:
    """A viser server whose frames are ``render(splats, ...)``; see the module docstring."""

    def __init__(self, splats: Splats, *, background: torch.Tensor, home: Orbit, size: tuple[int, int],
                 device: torch.device | str = "cpu", rasterize_mode: str = "classic", title: str = "") -> None:
        self.device = torch.device(device)
        self.splats = splats.to(self.device)
        self.background = background.to(self.device, torch.float32)
        self.home, self.size, self.rasterize_mode, self.title = home, size, rasterize_mode, title
        self.frames = 0  # frames sent, all clients
        # client id -> viser ClientHandle whose camera moved since its last frame (viser's types are Any to mypy)
        self._dirty: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._server: Any = None  # the viser server, once start() made it
        self._thread: threading.Thread | None = None

    # ---- one frame ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def frame(self, wxyz, position, fov_y: float, aspect: float) -> np.ndarray:  # -> [H, W, 3] uint8
        w, h = frame_size(aspect, self.size)
        view, k = camera_matrices(wxyz, position, fov_y, w, h)
        img, _, _ = render(self.splats, view[None].to(self.device), k[None].to(self.device), w, h,
                           background=self.background, rasterize_mode=self.rasterize_mode)
        return (img[0].clamp(0, 1) * 255 + 0.5).to(torch.uint8).cpu().numpy()

    # ---- serving ------------------------------------------------------------------------------------------

    def home_camera(self) -> dict:
        """Where a browser starts: the orbit's first eye looking at its centre, its up; the fov vertical (viser's),
        from the orbit's horizontal one at a 16:9 canvas."""
        o = self.home
        return {"position": tuple(o.eyes(torch.zeros(1, dtype=torch.float64))[0].tolist()),
                "look_at": tuple(o.center.tolist()), "up": tuple(o.up.tolist()),
                "fov": 2 * math.atan(math.tan(math.radians(o.fov_deg) / 2) * 9 / 16)}

    def start(self, host: str, port: int) -> str:
        """Serve on host:port (0: any free port); returns the URL. Frames render on a thread of their own."""
        import viser

        with contextlib.redirect_stdout(io.StringIO()):  # its banner; the caller prints the URL in its own words
            server = viser.ViserServer(host=host, port=port, label="warpforge splat view", verbose=False)
        self._server = server
        home = self.home_camera()
        server.scene.set_up_direction(home["up"])  # the orbit controls turn about the scene's up
        for key in ("position", "look_at", "up", "fov"):
            setattr(server.initial_camera, key, home[key])
        server.gui.add_markdown(f"**{self.title}**  \n{self.splats.n:,} Gaussians, drawn by warpforge's "
                                f"rasterizer on {self.device} at most {self.size[0]}x{self.size[1]}")

        @server.on_client_connect
        def _(client) -> None:
            client.camera.on_update(lambda cam: self._mark(cam.client))
            self._mark(client)  # the first pose arrived before this callback could listen for it

        @server.on_client_disconnect
        def _(client) -> None:
            with self._cond:
                self._dirty.pop(client.client_id, None)

        self._thread = threading.Thread(target=self._render_loop, name="splat-view-render", daemon=True)
        self._thread.start()
        return f"http://{host}:{server.get_port()}"

    def _mark(self, client) -> None:
        with self._cond:
            self._dirty[client.client_id] = client
            self._cond.notify()

    def _render_loop(self) -> None:
        warned = False
        while True:
            with self._cond:
                while not self._dirty and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                clients = list(self._dirty.values())
                self._dirty.clear()
            for client in clients:
                if client.client_id not in self._server.get_clients():
                    continue  # gone while waiting: its frame would only be dropped (with a warning)
                cam = client.camera
                try:
                    t0 = time.perf_counter()
                    image = self.frame(cam.wxyz, cam.position, cam.fov, cam.aspect)
                    client.scene.set_background_image(image, format="jpeg", jpeg_quality=90)
                except Exception as e:  # noqa: BLE001 - one bad frame (a client gone, a degenerate pose) must not
                    if not warned:  # end the viewer; say it once rather than once per frame
                        print(f"warpforge splat: view: warning: a frame failed ({type(e).__name__}: {e})",
                              file=sys.stderr, flush=True)
                        warned = True
                    continue
                self.frames += 1
                if self.frames == 1:
                    print(f"first frame: {image.shape[1]}x{image.shape[0]} in "
                          f"{(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._server is not None:
            with contextlib.redirect_stdout(io.StringIO()):  # "(viser) Server stopped"; the caller says it
                self._server.stop()
