"""`warpforge splat view`: viser's page in headless Chromium shows the frame our rasterizer drew for the browser's
camera; the pose and intrinsics conversion; what it accepts; one-line errors.

The browser test drives Chromium over the DevTools protocol (a few messages on the websocket viser brings): the
viewer's frames arrive over a websocket after the page has loaded, which a one-shot ``--screenshot`` with a
virtual-time budget does not wait for. WebGL runs on SwiftShader (Chromium's CPU renderer).
"""

from __future__ import annotations

import base64
import io
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from warpforge.cli import main
from warpforge.splat.scene import look_at, render, rotmat_to_quat, street_scene
from warpforge.splat.viewer import camera_matrices, frame_size

pytest.importorskip("viser", reason="the viewer needs viser (pip install 'warpforge[splat]')")

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("WARPFORGE_TEST_ARTIFACTS", REPO / "build" / "test-artifacts"))


def test_frame_size_keeps_the_canvas_aspect_inside_the_box():
    assert frame_size(16 / 9, (320, 240)) == (320, 180)
    assert frame_size(3 / 4, (320, 240)) == (180, 240)
    assert frame_size(4 / 3, (320, 240)) == (320, 240)
    assert frame_size(float("nan"), (320, 240)) == (320, 240)  # before a canvas has a size


def test_camera_matrices_invert_viser_pose():
    """viser reports camera-to-world (OpenCV axes, as ours); the viewmat is its inverse, K has square pixels."""
    eye, target = torch.tensor([[3.0, -4.0, 2.5]]), torch.tensor([[0.2, 0.1, 0.4]])
    view = look_at(eye, target)[0].double()  # world -> camera
    wxyz = rotmat_to_quat(view[:3, :3].T.numpy()[None])[0]  # camera -> world, as viser's wxyz
    fov_y = math.radians(50.0)
    vm, k = camera_matrices(wxyz, eye[0].numpy(), fov_y, 320, 180)
    torch.testing.assert_close(vm.double(), view, atol=1e-6, rtol=0)
    f = 90.0 / math.tan(fov_y / 2)
    torch.testing.assert_close(k, torch.tensor([[f, 0, 160.0], [0, f, 90.0], [0, 0, 1]]), atol=1e-4, rtol=0)


def _ply_folder(tmp: Path) -> Path:
    from warpforge.splat.ply import save_ply

    save_ply(street_scene(n=400, n_ring=2, n_drive=2).splats, tmp / "out" / "point_cloud.ply")
    return tmp / "out"


def test_view_sources(tmp_path):
    """street, a trained output folder (its PLY when there is no checkpoint), a PLY file."""
    from warpforge.splat.cli import load_view_source

    cpu = torch.device("cpu")
    splats, views, bg, aa, title = load_view_source("street", cpu)
    assert splats.n > 15_000 and len(views) == 16 and torch.allclose(bg, torch.tensor([0.62, 0.74, 0.88]))
    out = _ply_folder(tmp_path)
    for src in (out, out / "point_cloud.ply"):
        splats, views, _, aa, title = load_view_source(str(src), cpu)
        assert splats.n > 300 and views is None and not aa and title == str(out / "point_cloud.ply")


@pytest.mark.parametrize("args, message", [
    (["nowhere.ply"], "warpforge splat: nowhere.ply: no such file or folder (expected 'street'"),
    (["{tmp}"], "warpforge splat: {tmp}: no ckpt/last.pt or point_cloud.ply in this folder"),
    (["{tmp}/junk.pt"], "warpforge splat: {tmp}/junk.pt: not a readable checkpoint"),
    (["street", "--size", "big"], "warpforge splat: --size: expected WIDTHxHEIGHT"),
    (["street", "--port", "70000"], "warpforge splat: --port: 0..65535"),
    (["street", "--host", "256.1.1.1", "--port", "0"], "warpforge splat: --host 256.1.1.1 --port 0: cannot listen"),
])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    args = [a.format(tmp=tmp_path) for a in args]
    res = CliRunner().invoke(main, ["splat", "view", *args])
    assert res.exit_code == 2, res.output
    assert message.format(tmp=tmp_path) in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.output


def test_a_taken_port_is_named():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = CliRunner().invoke(main, ["splat", "view", "street", "--port", str(port)])
    assert res.exit_code == 2 and f"--host 127.0.0.1 --port {port}: cannot listen there" in res.stderr, res.output


# ---- the page in headless Chromium ---------------------------------------------------------------------------

VIEWPORT = (640, 480)
SIZE = (160, 120)  # the viewer's --size: small, a CPU frame in well under a second


class _DevTools:
    """The few DevTools-protocol calls the test needs, over one page's websocket."""

    def __init__(self, url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(url, max_size=None, proxy=None, open_timeout=30)
        self.n = 0

    def call(self, method: str, **params) -> dict:
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:  # events arrive between the replies; only the reply to this call matters
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.n:
                assert "error" not in msg, (method, msg["error"])
                return msg["result"]

    def screenshot(self) -> np.ndarray:  # [H, W, 3] uint8
        from PIL import Image

        png = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def _devtools_page(profile: Path, deadline: float) -> _DevTools:
    port_file = profile / "DevToolsActivePort"  # Chromium writes the port it took for --remote-debugging-port=0
    while not (port_file.is_file() and len(port_file.read_text().split()) >= 2):
        assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
        time.sleep(0.2)
    port = port_file.read_text().split()[0]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost, whatever the proxy env
    targets = json.loads(opener.open(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
    return _DevTools(next(t for t in targets if t["type"] == "page")["webSocketDebuggerUrl"])


def _expected_frame(width: int, height: int) -> np.ndarray:
    """The street as the viewer's home camera sees it at width x height, rendered here directly (look_at and a
    vertical fov; not through camera_matrices, so the browser check also checks the pose conversion)."""
    from warpforge.splat.cli import load_view_source
    from warpforge.splat.video import orbit_around
    from warpforge.splat.viewer import Viewer

    splats, views, bg, _, _ = load_view_source("street", torch.device("cpu"))
    home = Viewer(splats, background=bg, home=orbit_around(splats, views), size=SIZE).home_camera()
    f = 0.5 * height / math.tan(home["fov"] / 2)
    k = torch.tensor([[[f, 0, width / 2], [0, f, height / 2], [0, 0, 1]]])
    from warpforge.splat.video import _look

    vm = _look(torch.tensor([home["position"]], dtype=torch.float64), torch.tensor(home["look_at"]).double(),
               torch.tensor(home["up"]).double()).float()
    with torch.no_grad():
        img, _, _ = render(splats, vm, k, width, height, background=bg)
    return (img[0].clamp(0, 1) * 255 + 0.5).to(torch.uint8).numpy()


def _scene_region(a: np.ndarray) -> np.ndarray:
    """The part of the page only the scene covers: below viser's panel and notification (top corners), right of
    its axes gizmo (bottom left)."""
    h, w = a.shape[:2]
    return a[int(0.4 * h):int(0.95 * h), int(0.15 * w):int(0.85 * w)]


def _downsample(a: np.ndarray, width: int, height: int) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.fromarray(a).resize((width, height), Image.BOX))


@pytest.mark.timeout(300)
def test_viewer_draws_the_scene_in_chromium(chromium, tmp_path):
    view = subprocess.Popen([sys.executable, "-m", "warpforge", "splat", "view", "street", "--host", "127.0.0.1",
                             "--port", "0", "--size", f"{SIZE[0]}x{SIZE[1]}", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(ln) for ln in view.stdout], daemon=True).start()
    said: list[str] = []

    def read_lines(until: float, want: str | None = None) -> str | None:
        while time.monotonic() < until:
            try:
                said.append(lines.get(timeout=0.2))
            except queue.Empty:
                if view.poll() is not None:
                    break
                continue
            if want and said[-1].startswith(want):
                return said[-1]
        return None

    browser = None
    deadline = time.monotonic() + 200
    try:
        line = read_lines(time.monotonic() + 90, want="viewing ")
        assert line, f"the viewer did not start: {said} {view.stderr.read() if view.poll() is not None else ''}"
        url = line.split(" at ", 1)[1].split()[0]
        profile = tmp_path / "chromium-profile"
        browser = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
             "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        page = _devtools_page(profile, deadline)
        page.call("Emulation.setDeviceMetricsOverride", width=VIEWPORT[0], height=VIEWPORT[1], deviceScaleFactor=1,
                  mobile=False)
        page.call("Page.navigate", url=url)
        assert read_lines(deadline, want="first frame"), f"no frame was rendered: {said}"
        w, h = frame_size(VIEWPORT[0] / VIEWPORT[1], SIZE)
        want = _scene_region(_expected_frame(w, h)).astype(float)
        err = None
        while time.monotonic() < deadline:  # the frame reaches the canvas a moment after the server sent it
            shot = page.screenshot()
            assert shot.shape[:2] == VIEWPORT[::-1], shot.shape
            got = _scene_region(_downsample(shot, w, h)).astype(float)
            err = float(np.abs(got - want).mean())
            if err < 12:
                break
            time.sleep(1.0)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        from PIL import Image

        Image.fromarray(shot).save(ARTIFACTS / "splat-view.png")
        region = _scene_region(shot).astype(float)
        # drawn, not a blank canvas: varied, mostly not viser's white, and the frame we rendered for this camera
        # (JPEG at quality 90 and the browser's scaling leave a few levels; a blank page is ~150 away, a wrong
        # pose tens)
        assert region.std(axis=(0, 1)).mean() > 20, region.std(axis=(0, 1))
        assert (np.abs(region - 255).max(-1) > 40).mean() > 0.9
        assert err is not None and err < 12, f"mean |screenshot - our render| = {err:.1f} levels"
    finally:
        if browser is not None:
            os.killpg(browser.pid, signal.SIGKILL)
            browser.wait(timeout=30)
        if view.poll() is None:
            view.send_signal(signal.SIGINT)  # Ctrl-C
        try:
            rc = view.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(view.pid, signal.SIGKILL)
            view.wait()
            raise
    read_lines(time.monotonic() + 2)
    err_text = view.stderr.read()
    assert rc == 0 and said[-1].startswith("stopped after"), (rc, said, err_text)
    assert "Traceback" not in err_text, err_text
