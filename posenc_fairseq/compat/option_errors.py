"""End a command with one `error:` line when an encoding refuses an option value while the model is built.

fairseq's commands check options with argparse, which ends a bad value in `PROG: error: ...`. The
values an encoding can judge only when the model is built (combinations, computed sizes, a
checkpoint's stored options) raise OptionValueError from inside fairseq's model building, which
fairseq lets end in a traceback. This `sys.excepthook` prints such an error the way argparse would
(`PROG: error: MESSAGE` on stderr, no traceback; exit status 1, Python's for an uncaught
exception), also where fairseq re-raised it as another exception (keeping fairseq's words beside
it), and passes every other exception to the hook that was there before. Only this plugin
raises OptionValueError, so stock models see no change. POSENC_DEBUG=1 shows the traceback, with
any exception the refusal was raised from.
"""
import os
import sys


def option_error_in(error: BaseException, option_error_type):
    """`error` if it is an `option_error_type`, else the first one it was raised from or while
    handling (fairseq's trainer turns a failed checkpoint load into a plain Exception); else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, option_error_type):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def apply():
    if getattr(sys.excepthook, "reports_option_errors", False):
        return None
    from ..encodings.option_types import OptionValueError

    previous = sys.excepthook

    def report_option_errors_in_one_line(kind, error, traceback):
        refusal = option_error_in(error, OptionValueError)
        if refusal is not None and not os.environ.get("POSENC_DEBUG"):
            program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            # fairseq re-raises some errors as its own (a checkpoint that does not load): keep its words
            said = refusal if refusal is error else f"{error} ({refusal})"
            print(f"{program}: error: {said}", file=sys.stderr)
            return
        previous(kind, error, traceback)

    report_option_errors_in_one_line.reports_option_errors = True
    sys.excepthook = report_option_errors_in_one_line
    return ("fairseq's commands end an OptionValueError raised while the model is built in a traceback; "
            "it now ends in one `error:` line")
