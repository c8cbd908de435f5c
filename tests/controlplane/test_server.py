"""run_until_signal's ends other than a signal: the engine loop, or a supervised child given up."""

import asyncio
from types import SimpleNamespace

import pytest

from controlplane.server import ControlPlaneConfig, run_until_signal


def test_serve_stops_when_the_supervisor_of_its_data_plane_gives_up():
    """A data plane that keeps exiting (a checkpoint it cannot load, a GPU it cannot get): the
    supervisor stops restarting it, and the server stops too, with an error, instead of serving
    UNAVAILABLE forever."""
    async def main():
        stops = []

        async def start():
            pass

        async def stop(after_failure=False):  # (its cleanup lines quiet: the error follows)
            stops.append(after_failure)

        async def gives_up():
            pass
        engine = asyncio.create_task(asyncio.Event().wait())
        frontend = SimpleNamespace(name="gRPC front-end",
                                   task=asyncio.create_task(asyncio.Event().wait()))
        control_plane = SimpleNamespace(start=start, stop=stop, engine_task=engine,
                                        frontend_supervisors=[frontend])
        dataplane = SimpleNamespace(name="data plane", task=asyncio.create_task(gives_up()))
        try:
            with pytest.raises(RuntimeError, match="the data plane keeps exiting"):
                await run_until_signal(control_plane, children=[dataplane])
        finally:
            engine.cancel()
            frontend.task.cancel()
        return stops

    assert asyncio.run(main()) == [True]


@pytest.mark.parametrize("field", ["pipeline_depth", "stream_interval"])
def test_a_config_below_one_step_or_token_is_refused_naming_it(field, tmp_path):
    with pytest.raises(ValueError, match=rf"{field} \(0\)"):
        ControlPlaneConfig(model_dir=tmp_path, dataplane_address="ipc:///nowhere", **{field: 0})


def test_the_command_line_defaults_are_the_engines():
    """splitserve/cli_parser.py writes them out (it imports nothing of the planes, to keep
    `generate` and `health` light): they must stay the engine's."""
    from controlplane.engine import EngineConfig
    from splitserve.cli_parser import build_parser
    args = build_parser().parse_args(["serve"])
    assert (args.pipeline_depth, args.stream_interval) == \
        (EngineConfig.pipeline_depth, EngineConfig.stream_interval)
