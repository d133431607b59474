"""``fedasync erase``: talk to the erasure service of a running training server.

fedasync erase submit --silo N (--whole-silo | --samples a,b | --samples-file F)
                      [--key K] [--reason R]
fedasync erase status ID
fedasync erase list [--silo N] [--state S]
fedasync erase watch [ID] [--from-seq N]
fedasync erase refusals [--limit N]          refused calls (admin only)
fedasync erase certificate ID --out DIR      the request's erasure certificate: DIR/certificate.html
                                             and DIR/certificate.json (admin or the request's silo)
    offline, from the files alone (no service, no token): --run RUN_DIR (its erasures.sqlite and
    metrics.jsonl), or --store FILE [--events FILE]; and --reference RUN_DIR (repeatable):
    retraining reference runs, for the distance to retraining
fedasync erase credentials DIR --silos N     make tokens (DIR/tokens.json, keep it secret)
                                             and their hashes (DIR/credentials.json, server)

Common options: --address host:port (default $FEDASYNC_ERASURE_ADDRESS or 127.0.0.1:50151),
--token (default $FEDASYNC_TOKEN) or --token-file (one token, or a tokens file with --as
admin | silo-N; submit takes the entry of its --silo), --ca-cert FILE for TLS (the
deployment's ca.pem; --tls-ca is the same), --json.
Exit codes: 0 ok, 1 failed call, 2 authentication / permission / usage (and, for a
certificate, an unknown request or a missing file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from server.erasure.auth import generate_credentials, write_private
from server.erasure.gen import erasure_pb2 as pb
from server.erasure.gen import erasure_pb2_grpc
from server.erasure.limits import Limits, named, quoted

DEFAULT_ADDRESS = "127.0.0.1:50151"
STATES = ("queued", "erasing", "calibrating", "verified", "unverified", "failed")
AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--address",
        default=os.environ.get("FEDASYNC_ERASURE_ADDRESS", DEFAULT_ADDRESS),
        help="host:port of the erasure service",
    )
    common.add_argument("--token", default=os.environ.get("FEDASYNC_TOKEN"), help="bearer token")
    common.add_argument(
        "--token-file",
        type=Path,
        help="file holding the bearer token, or a tokens file (JSON, as `erase credentials` "
        "and a run write it) with --as",
    )
    common.add_argument(
        "--as",
        dest="as_name",
        help="whose token of a tokens file: admin or silo-N (submit: silo-N of --silo)",
    )
    common.add_argument(
        "--ca-cert", "--tls-ca", dest="tls_ca", type=Path, help="CA certificate (PEM): use TLS"
    )
    common.add_argument("--json", action="store_true", help="print JSON, one object a line")
    common.add_argument("--timeout", type=float, default=30.0, help="seconds per unary call")

    parser = argparse.ArgumentParser(prog="fedasync erase", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    submit = sub.add_parser("submit", parents=[common], help="ask to erase a silo or samples")
    submit.add_argument("--silo", type=int, required=True)
    group = submit.add_mutually_exclusive_group(required=True)
    group.add_argument("--whole-silo", action="store_true", help="erase the whole silo")
    group.add_argument("--samples", help="comma-separated sample ids")
    group.add_argument("--samples-file", type=Path, help="file with one sample id a line")
    submit.add_argument("--key", default="", help="idempotency key: a retry returns the same id")
    submit.add_argument("--reason", default="", help="free text kept in the audit log")
    status = sub.add_parser("status", parents=[common], help="show one request")
    status.add_argument("id")
    lst = sub.add_parser("list", parents=[common], help="list requests")
    lst.add_argument("--silo", type=int)
    lst.add_argument("--state", choices=STATES, action="append", help="repeatable")
    watch = sub.add_parser("watch", parents=[common], help="follow state changes")
    watch.add_argument("id", nargs="?", default="", help="one request (ends when it is done)")
    watch.add_argument("--from-seq", type=int, default=0, help="first event seq to show")
    refusals = sub.add_parser("refusals", parents=[common], help="refused calls (admin only)")
    refusals.add_argument("--limit", type=int, default=20, help="newest rows to show")
    _certificate_parser(sub, common)
    creds = sub.add_parser("credentials", help="generate tokens for an admin and N silos")
    creds.add_argument("dir", type=Path)
    creds.add_argument("--silos", type=int, required=True)
    return parser


def _certificate_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    cert = sub.add_parser(
        "certificate",
        parents=[common],
        help="the erasure certificate of one request (HTML and JSON)",
    )
    cert.add_argument("id", help="the request's id")
    cert.add_argument("--out", type=Path, required=True, help="folder to write the two files to")
    offline = cert.add_argument_group("offline: from the files, without the service")
    offline.add_argument("--run", type=Path, help="run folder (erasures.sqlite, metrics.jsonl)")
    offline.add_argument("--store", type=Path, help="erasure store file (erasures.sqlite)")
    offline.add_argument("--events", type=Path, help="the run's event log (with --store)")
    offline.add_argument(
        "--reference",
        type=Path,
        action="append",
        default=[],
        help="retraining reference run folder (repeatable; offline only)",
    )


def _ms(ms: int) -> str | None:
    from server.erasure.certificate import iso

    return iso(ms)


def _state(value: int) -> str:
    return pb.State.Name(value).lower()


def format_request(r: pb.ErasureRequest) -> str:
    """One readable line for an ``ErasureRequest``."""
    what = "whole silo" if r.whole_silo else f"{len(r.sample_ids)} sample(s)"
    line = (
        f"{r.id}  silo {r.silo}  {what}  {_state(r.state)}"
        f"  by {r.requester} at v{r.model_version_at_submit}"
        f"  updated {_ms(r.updated_at_ms)}"
    )
    if r.boundary_version >= 0:
        line += f"  boundary v{r.boundary_version}"
    if r.failure_reason:
        line += f"  failed: {r.failure_reason}"
    if r.metrics:
        line += "  " + " ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items()))
    return line


def format_event(e: pb.ErasureEvent) -> str:
    """One readable line for an ``ErasureEvent``."""
    line = (
        f"#{e.seq} {_ms(e.time_ms)}  {e.request_id}  silo {e.silo}"
        f"  -> {_state(e.state)} at v{e.model_version} by {e.actor}"
    )
    if e.detail:
        line += f"  ({e.detail})"
    return line


def format_refusal(r: pb.Refusal) -> str:
    """One readable line for a refused call."""
    return f"{_ms(r.time_ms)}  {r.code}  {r.who} ({r.peer})  {r.method}  {r.reason}"


def format_refusal_count(c: pb.RefusalCount) -> str:
    """One readable line for a count of refused calls."""
    return f"{c.count:>8}  {c.code}  {c.who}  {c.method}  last {_ms(c.last_ms)}"


def _emit(message: Message, as_json: bool, fmt: Callable[[Any], str]) -> None:
    if as_json:
        print(
            json.dumps(
                MessageToDict(message, always_print_fields_with_no_presence=True),
                sort_keys=True,
            ),
            flush=True,
        )
    else:
        print(fmt(message), flush=True)


MAX_TOKEN_FILE = 65536
"""The most bytes a token file may hold (a tokens file of thousands of silos fits)."""
TOKEN_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))
"""What a bearer token may hold: printable ASCII without spaces (gRPC metadata)."""


class TokenError(ValueError):
    """A token or token file that cannot be used: one line, never the secret itself."""


def _token(args: argparse.Namespace) -> str | None:
    """The bearer token: ``--token-file`` (one token, or a tokens file and whose entry:
    ``--as``, else for ``submit`` the entry of ``--silo``), else ``--token`` /
    ``$FEDASYNC_TOKEN``. TokenError when it is not one; OSError when the file is unreadable."""
    if args.token_file is None:
        if args.as_name:
            raise TokenError("--as names an entry of a tokens file: give it with --token-file")
        return _checked(args.token, "--token") if args.token else args.token
    path = args.token_file
    with path.open("rb") as f:
        raw = f.read(MAX_TOKEN_FILE + 1)
    if len(raw) > MAX_TOKEN_FILE:
        raise TokenError(f"{quoted(str(path))} holds over {MAX_TOKEN_FILE} bytes: not a token file")
    text = raw.decode("utf-8", errors="replace").strip()
    if not text.startswith("{"):
        if args.as_name:
            raise TokenError(f"--as {quoted(args.as_name)}: {quoted(str(path))} holds one token")
        return _checked(text, quoted(str(path)))
    try:
        tokens = json.loads(text)
    except ValueError:
        tokens = None
    if not isinstance(tokens, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()
    ):
        raise TokenError(f"{quoted(str(path))} is not a tokens file (a JSON object name -> token)")
    name = args.as_name
    if name is None and args.cmd == "submit":
        name = f"silo-{args.silo}"
    if name is None and len(tokens) == 1:
        name = next(iter(tokens))
    names = named(sorted(tokens))
    if name is None:
        raise TokenError(
            f"{quoted(str(path))} holds {len(tokens)} tokens ({names}): say whose with --as"
        )
    if name not in tokens:
        raise TokenError(f"{quoted(str(path))} has no token for {quoted(name)} (it has {names})")
    return _checked(tokens[name], f"{quoted(name)} of {quoted(str(path))}")


def _checked(token: str, where: str) -> str:
    """``token`` when it can be sent as a bearer token; TokenError naming ``where`` (never the
    token) otherwise."""
    if not token or len(token) > 4096 or not set(token) <= TOKEN_CHARS:
        raise TokenError(
            f"the token of {where} is not one (a token is one line of printable characters, "
            "no spaces)"
        )
    return token


def _channel(args: argparse.Namespace) -> grpc.Channel:
    # a Certificate answer may be up to Limits.max_certificate_bytes (gRPC's default: 4 MiB)
    options = [("grpc.max_receive_message_length", Limits().max_certificate_bytes + 65536)]
    if args.tls_ca is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=args.tls_ca.read_bytes())
        return grpc.secure_channel(args.address, creds, options=options)
    return grpc.insecure_channel(args.address, options=options)


def _credentials(args: argparse.Namespace) -> int:
    args.dir.mkdir(parents=True, exist_ok=True)
    hashes, plain = args.dir / "credentials.json", args.dir / "tokens.json"
    tokens = generate_credentials(args.silos, hashes)
    write_private(plain, tokens)
    print(f"server credentials (hashes): {hashes}")
    print(f"tokens (secret; hand each silo its own, mode 0600): {plain}")
    return 0


def _call(
    args: argparse.Namespace, stub: erasure_pb2_grpc.ErasureStub, metadata: list[tuple[str, str]]
) -> None:
    t = args.timeout
    if args.cmd == "submit":
        ids: list[str] = []
        if args.samples:
            ids = [s.strip() for s in args.samples.split(",") if s.strip()]
        elif args.samples_file is not None:
            ids = [s.strip() for s in args.samples_file.read_text().splitlines() if s.strip()]
        if not args.whole_silo and not ids:
            raise ValueError("no sample ids given (use --whole-silo to erase the whole silo)")
        msg = pb.SubmitRequest(
            silo=args.silo,
            sample_ids=ids,
            whole_silo=args.whole_silo,
            idempotency_key=args.key,
            reason=args.reason,
        )
        _emit(stub.Submit(msg, metadata=metadata, timeout=t), args.json, format_request)
    elif args.cmd == "status":
        r = stub.Get(pb.GetRequest(id=args.id), metadata=metadata, timeout=t)
        _emit(r, args.json, format_request)
    elif args.cmd == "list":
        msg = pb.ListRequest(states=[pb.State.Value(s.upper()) for s in args.state or ()])
        if args.silo is not None:
            msg.silo = args.silo
        for r in stub.List(msg, metadata=metadata, timeout=t).requests:
            _emit(r, args.json, format_request)
    elif args.cmd == "watch":
        msg = pb.WatchRequest(request_id=args.id, from_seq=args.from_seq)
        for e in stub.Watch(msg, metadata=metadata):
            _emit(e, args.json, format_event)
    elif args.cmd == "certificate":
        reply = stub.Certificate(
            pb.CertificateRequest(request_id=args.id), metadata=metadata, timeout=t
        )
        _write_certificate(args, reply.json, reply.html)
    elif args.cmd == "refusals":
        reply = stub.ListRefusals(
            pb.ListRefusalsRequest(limit=args.limit), metadata=metadata, timeout=t
        )
        for c in reply.counts:
            _emit(c, args.json, format_refusal_count)
        for r in reply.refusals:
            _emit(r, args.json, format_refusal)


def _write_certificate(args: argparse.Namespace, text: str, page: str) -> None:
    """Write ``certificate.json`` and ``certificate.html`` into ``--out``; say where."""
    args.out.mkdir(parents=True, exist_ok=True)
    paths = {"json": args.out / "certificate.json", "html": args.out / "certificate.html"}
    paths["json"].write_text(text, encoding="utf-8")
    paths["html"].write_text(page, encoding="utf-8")
    if args.json:
        print(json.dumps({k: str(v) for k, v in paths.items()}, sort_keys=True), flush=True)
    else:
        print(f"certificate of {args.id}: {paths['html']} and {paths['json']}", flush=True)


def _offline_certificate(args: argparse.Namespace) -> int:
    """``certificate`` from the files (``--run``, or ``--store`` [``--events``]): no service.
    An unknown request or a missing file: one line, exit 2."""
    from server.erasure.certificate import build, to_json
    from server.erasure.certificate_html import render
    from server.erasure.records import RequestNotFound
    from server.erasure.store import ErasureStore

    if args.run is not None and (args.store is not None or args.events is not None):
        return _usage("give --run, or --store with --events, not both")
    if args.events is not None and args.store is None:
        return _usage("--events needs --store (or give --run)")
    store_path = args.store if args.run is None else args.run / "erasures.sqlite"
    events = args.events
    if args.run is not None and (args.run / "metrics.jsonl").is_file():
        events = args.run / "metrics.jsonl"
    for path in (events, *(r / "metrics.jsonl" for r in args.reference)):
        if path is not None and not path.is_file():
            return _usage(f"no such file: {path}")
    try:
        store = ErasureStore(store_path, readonly=True)
    except (OSError, ValueError) as e:
        return _usage(f"cannot read the erasure store: {e}")
    try:
        cert = build(store, args.id, events=events, references=args.reference)
    except RequestNotFound:
        return _usage(f"no erasure request {quoted(args.id)} in {store_path}")
    finally:
        store.close()
    _write_certificate(args, to_json(cert), render(cert))
    return 0


def _usage(message: str) -> int:
    print(f"fedasync erase: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run ``fedasync erase`` with ``argv`` (without the leading ``erase``)."""
    args = _parser().parse_args(argv)
    if args.cmd == "credentials":
        return _credentials(args)
    if args.cmd == "certificate" and any(
        x is not None for x in (args.run, args.store, args.events)
    ):
        return _offline_certificate(args)
    if args.cmd == "certificate" and args.reference:
        return _usage("--reference is for a certificate built offline (with --run or --store)")

    try:
        token = _token(args)
    except OSError as e:
        print(f"fedasync erase: cannot read token file: {quoted(str(e))}", file=sys.stderr)
        return 2
    except TokenError as e:
        print(f"fedasync erase: {e}", file=sys.stderr)
        return 2
    metadata = [("authorization", f"Bearer {token}")] if token else []
    try:
        channel = _channel(args)
    except OSError as e:
        print(f"fedasync erase: cannot read the TLS root certificate: {e}", file=sys.stderr)
        return 1
    try:
        _call(args, erasure_pb2_grpc.ErasureStub(channel), metadata)
    except grpc.RpcError as e:
        code = e.code()
        print(f"fedasync erase: {code.name}: {e.details()}", file=sys.stderr)
        unknown = args.cmd == "certificate" and code is grpc.StatusCode.NOT_FOUND
        return 2 if code in AUTH_CODES or unknown else 1
    except OSError as e:
        print(f"fedasync erase: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"fedasync erase: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
