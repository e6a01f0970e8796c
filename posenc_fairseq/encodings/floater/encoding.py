"""The FLOATER encoding: its options, which projections it serves (its slots), and the hooks that
hand each q/k/v projection its bias b(t_i) = b(0) + table[i].

The slots are (role, layer, q|k|v) of every attention the model binds to the encoding (`bind_model`:
the model passes its attention layers). Per forward pass and per group of slots that see the same
positions (the encoder's q/k/v; the decoder's q/k/v with the cross-attention queries; the
cross-attention keys and values) b(0) + table is formed once on the (rows, slots, d) table and
gathered at the tokens' positions (`GatherSlots`); the stacks' `begin` computes every slot's biases
before the layers run. Which table a pass reads: table.py; how it is solved: solver.py.
"""
import math
from typing import List, Optional

import torch
from omegaconf import DictConfig
from torch import Tensor, nn

from ..base import ROLES, PositionalEncoding, register_encoding
from ..cache import stack_of
from ..option_types import OptionValueError, flag, float_in_range, given, int_in_range, one_of, option, positive_int
from ..positions import AnyPositions, Positions, bounds, is_shared_range, tensor_of
from . import solver
from .dynamics import Dynamics
from .solver import FIXED_GRID, MAX_STEPS_PER_POSITION, METHODS, SolverOptions
from .table import BiasLimit, PassTables, Tables, Window, bias_limit, overflow_error, snapshot

INITS = ("zero", "small")
DELTA = float_in_range(0.0, 1000.0, low_open=True)
STEP_SIZE = float_in_range(0.0, 1000.0, low_open=True)
TOLERANCE = float_in_range(0.0, 1.0, low_open=True, high_open=True)
HIDDEN = int_in_range(1, 65536)
LR_SCALE = float_in_range(0.0, 1e4, low_open=True)
MAX_SPEED = float_in_range(0.0, 1e4, low_open=True)
DECAY = float_in_range(0.0, 1e3)


class PassState:
    """FLOATER's state of one forward pass of the model (an entry of the cache's model-pass scope,
    which spans both stacks: its table covers the positions of either). Plain attributes: made
    once per decoding step, where nn.Module's __setattr__ would cost."""
    __slots__ = ("solved_from", "tables", "group_tables", "gathered", "biases", "needed", "step_positions",
                 "step_biases")

    def __init__(self, solved_from: Optional[list] = None):
        # `Floater.solve_input_versions()` when an encoder's pass began (the one pass a later call, the
        # decoder's, continues; not made per decoding step, whose pass is its own)
        self.solved_from = solved_from
        self.tables = PassTables()  # the tables solved in this pass
        self.group_tables = {}  # (group, dtype) -> (table values, b(t) of the group's slots)
        self.gathered = {}  # (group, dtype, shared range or None) -> (table values, positions, biases there)
        self.biases = {}  # (role, layer, which) -> (positions, that slot's biases there)
        self.needed = 0  # positions 0..needed-1 occur in this pass
        # a later decoding step in inference: its target tokens' positions (the pass context's, as
        # given) and their biases, {(role, layer, which): (d,) bias} of the target group's slots
        self.step_positions, self.step_biases = None, None


class GatherSlots(torch.autograd.Function):
    """Rows `index` of the group's table, (rows, slots, d) -> one (length, batch, d) per slot (views
    of one gather), with one index_select along the rows; backward adds the slots' gradients into
    the table with one index_add, rather than per-slot index_add along an inner dimension or
    advanced indexing's backward (docs/benchmarks.md, "Per-distance arithmetic")."""

    @staticmethod
    def forward(ctx, group_table: Tensor, index: Tensor, batch: int, length: int):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(index)
        ctx.table_shape = group_table.shape
        return GatherSlots.gather(group_table, index, batch, length)

    @staticmethod
    def gather(group_table: Tensor, index: Tensor, batch: int, length: int) -> tuple:
        """The forward alone (no autograd node: decoding steps)."""
        rows, slots, width = group_table.shape
        return group_table.index_select(0, index).view(length, batch, slots, width).unbind(2)

    @staticmethod
    def backward(ctx, *grads):
        index, = ctx.saved_tensors
        rows, slots, width = ctx.table_shape
        present = next((grad for grad in grads if grad is not None), None)
        if present is None:
            return None, None, None, None
        grads = [grad if grad is not None else present.new_zeros(()).expand_as(present) for grad in grads]
        # summed over the batch (a left-padded source's positions repeat across rows): in float32 for
        # fp16/bf16 (CUDA's index_add_ adds atomically in the tensor's dtype, each add rounded)
        accumulate = torch.promote_types(present.dtype, torch.float32)
        grad_table = present.new_zeros(rows, slots * width, dtype=accumulate)
        grad_table.index_add_(0, index, torch.stack(grads, dim=-2).reshape(-1, slots * width).to(accumulate))
        return grad_table.view(rows, slots, width).to(present.dtype), None, None, None


def run_optimizer(args) -> Optional[str]:
    """The run's optimizer as the model's options tell it: fairseq-train's `--optimizer`; under
    fairseq-hydra-train the model's config is a node of the run's, whose `optimizer._name` it is;
    None where neither says (a model built outside a training run)."""
    optimizer = getattr(args, "optimizer", None)
    if isinstance(optimizer, str):
        return optimizer
    parent = args._get_parent() if isinstance(args, DictConfig) else None
    chosen = parent.get("optimizer") if isinstance(parent, DictConfig) else None
    name = chosen.get("_name") if isinstance(chosen, DictConfig) else None
    return name if isinstance(name, str) else None


@register_encoding("floater")
class Floater(PositionalEncoding):
    """b(t_i) for every q/k/v projection of the attention layers the model binds to it (the package
    docstring gives the equation); h is `dynamics`, the tables are in `tables`."""
    default_input_positions = "stock"

    def __init__(self, args, dims):
        super().__init__(args, dims)
        hidden, max_speed, decay, stop_time = self._read_options(args, dims.embed_dim)
        self.dynamics = Dynamics(dims.embed_dim, hidden, self.init, self.autonomous, max_speed, decay, stop_time)
        if self.freeze_dynamics:
            self.dynamics.requires_grad_(False)
        if self.dynamics_lr_scale != 1.0:
            # fairseq's composite optimizer (dynamic groups) gives these their own group: lr * scale
            for parameter in self.dynamics.parameters():
                parameter.optim_overrides = {"optimizer": {"lr_scale": self.dynamics_lr_scale}}
        # plain attributes, not submodules: the model owns the attention modules and their biases
        self._slots = []  # [(role, layer, which, attention module)]
        self._slot_index, self._slot_keys = {}, []
        self._groups = {}  # (role, which) -> the slots whose biases are gathered together (same positions)
        self._target_keys = []  # the slot keys of the target tokens' group, in its order
        self._num_updates = 0
        # a loaded checkpoint's window and the update count it was loaded at (`_after_load`), until
        # `set_num_updates` or a training pass decides whether training resumes it
        self._resumable_window = None
        # the keys of FLOATER's entries in its cache: the pass's state (model-pass scope); the
        # evaluation table, each group's b(t) on it and the rows a decoding step reads (inference
        # scope); whether this decode's first call made those rows (decode scope)
        self.pass_key = self.term_key("model", "pass state")
        self.evaluation_key = self.term_key("model", "evaluation table")
        self.step_rows_key = self.term_key("decoder", "step rows")
        self.step_ready_key = self.term_key("decoder", "step rows ready")
        self._forget_tables()  # (creates `tables`, the K-window of this encoding: table.py)
        self.register_load_state_dict_post_hook(Floater._after_load)

    def _read_options(self, args, dim: int) -> tuple:
        """FLOATER's options read, checked against each other and kept as attributes (those that define
        the tables recorded in the order read: trained_with.py); returns the dynamics' own (hidden
        width, maximum speed, decay, stop time)."""
        def floater(name, checker, default, defines=True):
            """FLOATER's option `name`; `defines`: whether it defines the tables (else training alone)."""
            read = self.defining_option if defines else option
            return read(args, f"floater_{name}", checker, default)

        self.delta = floater("delta", DELTA, 0.1)
        self.method = floater("method", one_of(*METHODS), "rk4")
        self.step_size = floater("step_size", STEP_SIZE, self.delta / 5, defines=False)
        self.substeps = max(1, math.ceil(self.delta / self.step_size - 1e-9))
        if self.method in FIXED_GRID:  # the step the solve takes (step sizes of equal substeps are one model)
            self.record_option("floater_step_size", self.delta / self.substeps,
                               given(args, "floater_step_size") is not None, follows=["floater_delta"])
            self.not_read(args, "floater_tolerance", "only --floater-method dopri5 reads it")
        else:
            self.not_read(args, "floater_step_size", "dopri5 chooses its own steps (--floater-tolerance)")
        if self.method in FIXED_GRID and self.substeps > MAX_STEPS_PER_POSITION:
            raise OptionValueError(f"--floater-step-size {self.step_size:g}: {self.substeps} solver steps per position "
                                   f"(--floater-delta {self.delta:g}); at most {MAX_STEPS_PER_POSITION} are allowed")
        self.tolerance = floater("tolerance", TOLERANCE, 1e-6, defines=self.method not in FIXED_GRID)
        self.adjoint = floater("adjoint", flag, False, defines=False)
        self.first_block_only = floater("first_block_only", flag, False)
        self.recompute_every = floater("recompute_every", positive_int, 1, defines=False)
        hidden = floater("hidden", HIDDEN, dim)
        self.init = floater("init", one_of(*INITS), "zero", defines=False)
        self.freeze_dynamics = floater("freeze_dynamics", flag, False, defines=False)
        self.train_dynamics_only = floater("train_dynamics_only", flag, False, defines=False)
        if self.freeze_dynamics and self.train_dynamics_only:
            raise OptionValueError("--floater-freeze-dynamics and --floater-train-dynamics-only exclude each other")
        self.dynamics_lr_scale = floater("dynamics_lr_scale", LR_SCALE, 1.0, defines=False)
        if self.freeze_dynamics and self.dynamics_lr_scale != 1.0:  # (h would not move at any rate)
            raise OptionValueError("--floater-dynamics-lr-scale with --floater-freeze-dynamics: h is not trained")
        optimizer = run_optimizer(args)
        if self.dynamics_lr_scale != 1.0 and isinstance(optimizer, str) and optimizer != "composite":
            raise OptionValueError(f"--floater-dynamics-lr-scale needs fairseq's composite optimizer (got --optimizer "
                                   f"{optimizer}); see docs/floater.md")
        self.autonomous = floater("autonomous", flag, False)
        if self.autonomous and self.recompute_every > 1:  # (a window's snapshot holds the raw time columns)
            raise OptionValueError("--floater-autonomous with --floater-recompute-every > 1 is not supported")
        max_speed, decay = floater("max_speed", MAX_SPEED, None), floater("decay", DECAY, 0.0)
        self.stop_position = floater("stop_position", positive_int, None)
        # halfway between positions N-1 and N, away from both: every stage time of the intervals up to
        # position N-1 lies before it (those positions keep the plain flow), every one after position N
        # lies after it (positions >= N share b(t_N), the flow up to (N - 1/2) delta)
        stop_time = None if self.stop_position is None else (self.stop_position - 0.5) * self.delta
        return hidden, max_speed, decay, stop_time

    @staticmethod
    def add_args(parser):
        parser.add_argument("--floater-delta", type=DELTA, metavar="D", help="time between tokens, t_i = i*D (default 0.1)")
        parser.add_argument("--floater-method", choices=METHODS, help="ODE solver (default rk4)")
        parser.add_argument("--floater-step-size", type=STEP_SIZE, metavar="S",
                            help=f"fixed-grid solver step (default delta/5; rounded so it divides delta; "
                                 f"at most {MAX_STEPS_PER_POSITION} steps per position)")
        parser.add_argument("--floater-tolerance", type=TOLERANCE, metavar="TOL", help="rtol = atol of dopri5 (default 1e-6)")
        parser.add_argument("--floater-adjoint", action="store_true", default=None,
                            help="gradients by torchdiffeq's continuous adjoint (odeint_adjoint)")
        parser.add_argument("--floater-hidden", type=HIDDEN, metavar="H", help="hidden width of h (default: embed dim)")
        parser.add_argument("--floater-init", choices=INITS,
                            help="last layer of h: zero (exactly the stock model, default) or small random")
        parser.add_argument("--floater-autonomous", action="store_true", default=None,
                            help="h(b) without the time input (the paper's h also sees tau); see docs/floater.md")
        parser.add_argument("--floater-max-speed", type=MAX_SPEED, metavar="S",
                            help="db/dt = S tanh(h/S): every coordinate of b moves at most S per unit of time "
                                 "(default: unbounded, the paper's h); see docs/floater.md")
        parser.add_argument("--floater-decay", type=DECAY, metavar="L",
                            help="db/dt multiplied by exp(-L t): with --floater-max-speed S, |b(t) - b(0)| <= S/L "
                                 "at every position (default 0: none)")
        parser.add_argument("--floater-stop-position", type=positive_int, metavar="N",
                            help="the flow stops halfway between positions N-1 and N: positions >= N share one bias "
                                 "(e.g. N = the longest training input in tokens, </s> included; default: never)")
        parser.add_argument("--floater-first-block-only", action="store_true", default=None,
                            help="FLOATER biases only in layer 0 of each stack (paper's 'input block only')")
        parser.add_argument("--floater-recompute-every", type=positive_int, metavar="K",
                            help="solve the ODE with gradient every K updates, reuse the table in between (default 1)")
        parser.add_argument("--floater-freeze-dynamics", action="store_true", default=None,
                            help="do not train the dynamics network h")
        parser.add_argument("--floater-train-dynamics-only", action="store_true", default=None,
                            help="train only h: every other parameter of the model as built (including the b(0) "
                                 "projection biases) is frozen; a head the task adds later (sentence_prediction's "
                                 "classification head) trains")
        parser.add_argument("--floater-dynamics-lr-scale", type=LR_SCALE, metavar="X",
                            help="learning rate of h = X * the others' (needs fairseq's composite optimizer; default 1)")

    @classmethod
    def depth_changed_by_pruning(cls, args, role, kept):
        if getattr(args, "floater_first_block_only", None) and kept[0] != 0:
            return (f"--floater-first-block-only serves the {role}'s first layer: without layer 0 it would serve "
                    f"layer {kept[0]}")
        return None

    # --- binding ------------------------------------------------------------------------------
    def bind_model(self, model: nn.Module, attentions):
        """Serve `attentions`, the (role, layer, attention module) the model binds to this encoding:
        their q/k/v projections become the slots, their biases the initial values b(0)."""
        slots = []
        for role, layer, module in attentions:
            if self.first_block_only and layer != 0:
                continue
            for which in "qkv":
                if getattr(module, f"{which}_proj").bias is None:
                    raise ValueError("FLOATER needs attention projections with biases (the ODE's initial values)")
                slots.append((role, layer, which, module))
        slots.sort(key=lambda slot: (ROLES.index(slot[0]), slot[1], "qkv".index(slot[2])))
        self._slots = slots
        self._slot_keys = [slot[:3] for slot in slots]  # (role, layer, which)
        self._slot_index = {key: index for index, key in enumerate(self._slot_keys)}
        # the slots that see the same positions in a pass, gathered together: the encoder's q/k/v
        # (source tokens); the decoder's q/k/v with the cross-attention queries (target tokens:
        # one gather per decoding step); the cross-attention keys and values (source positions)
        def group(role, which):
            if role == "encoder":
                return "encoder"
            return "source" if role == "cross" and which != "q" else "target"
        self._groups = {(role, which): tuple(i for i, slot in enumerate(slots) if group(slot[0], slot[2]) == group(role, which))
                        for role in ROLES for which in "qkv"}
        self._target_keys = [self._slot_keys[slot] for slot in self._groups.get(("decoder", "q"), ())]
        self._forget_tables()
        if self.train_dynamics_only:
            dynamics = {id(p) for p in self.dynamics.parameters()}
            for parameter in model.parameters():
                if id(parameter) not in dynamics:
                    parameter.requires_grad_(False)

    def initial_parameters(self) -> List[Tensor]:
        """The b(0) of every slot: the attention projections' own biases (over all the original
        heads, also after fairseq's head pruning)."""
        return [module.full_projection_bias(which) for _, _, which, module in self._slots]

    def initial_values(self) -> Tensor:
        return torch.stack(self.initial_parameters())

    def solve_inputs(self) -> List[Tensor]:
        """What a table is solved from: h's parameters and every slot's b(0)."""
        return [*self.dynamics.parameters(), *self.initial_parameters()]

    def solve_input_versions(self) -> list:
        """[(tensor, version)] of every stored tensor a table is solved from: h's parameters and the
        projection biases (with their pruned heads' values). A replacement, or an in-place change that
        torch counts (torch.optim's steps, load_state_dict, in-place ops), makes `same_versions` false. A
        write through `.data` (fairseq's own optimizers) is not counted by torch: such a change between
        the encoder's and the decoder's call of one pass goes unseen (a training step never makes one)."""
        tensors = [*self.dynamics.parameters()]
        for _, _, which, module in self._slots:
            tensors += module.projection_bias_tensors(which)
        return [(tensor, tensor._version) for tensor in tensors]

    @staticmethod
    def same_versions(kept: list, now: list) -> bool:
        """Whether two `solve_input_versions` are of the same tensors (the objects themselves: an id may
        be reused once a replaced tensor is freed, and `kept` holds them) at the same versions."""
        return len(kept) == len(now) and all(a is b and u == v for (a, u), (b, v) in zip(kept, now))

    def table_options(self) -> tuple:
        """What a table depends on besides `solve_inputs`: the solver options, h's form and the slots."""
        return self.solver_options(), self.dynamics.form, tuple(self._slot_index)

    def solver_options(self) -> SolverOptions:
        return SolverOptions(self.method, self.delta, self.substeps, self.tolerance, self.adjoint)

    def reset_to_identity(self):
        """h == 0 (zero last layer): b(t) == b(0) and the model equals the stock model."""
        self.dynamics.initialise("zero")
        self._forget_tables()

    def apply_init_option(self):
        """The initialisation `--floater-init` asked for, on top of the identity (conversion)."""
        if self.init != "zero":
            self.dynamics.initialise(self.init)
            self._forget_tables()

    def _forget_tables(self):
        self.tables = Tables()
        self.cache.clear()

    def pass_state(self) -> PassState:
        """This forward pass's state (the cache's model-pass scope)."""
        state = self.cache.model_pass.get(self.pass_key)
        if state is None:
            state = self.cache.model_pass[self.pass_key] = PassState()
        return state

    def kept_value_inputs(self):
        """What the kept evaluation table (and all kept values) are computed from: h's parameters
        and every slot's b(0)."""
        return self.solve_inputs()

    def __getstate__(self):  # copies (fairseq's EMA deep-copies the model) start without a window
        state = super().__getstate__()
        state.update(tables=Tables())
        return state

    # --- solving ------------------------------------------------------------------------------
    def solve_dtype(self) -> torch.dtype:
        """float32, or float64 for a float64 model: never the half precisions of fp16/bf16."""
        return torch.promote_types(self.dynamics.fc1.weight.dtype, torch.float32)

    def model_dtype(self) -> torch.dtype:
        """The dtype the biases are used in (a table's rows must fit it)."""
        return self.dynamics.fc1.weight.dtype

    def bias_limit(self) -> BiasLimit:
        """The largest |b(t) - b(0)| the model takes (`table.bias_limit`, over the width d)."""
        return bias_limit(self.model_dtype(), self.dims.embed_dim)

    def _live_parameters(self):
        dtype = self.solve_dtype()
        return self.dynamics.weights(dtype), self.initial_values().to(dtype)

    def solve(self, rows: int, parameters=None) -> Tensor:
        """Table b(t_i) - b(0) for positions 0..rows-1 (in the autograd graph of `parameters`,
        default the live ones), in the solve dtype."""
        weights, b0 = parameters if parameters is not None else self._live_parameters()
        return solver.solve(self.dynamics, self.solver_options(), b0, 0, max(rows, 2) - 1, weights,
                            self.cache.constant) - b0

    def extend(self, table: Tensor, rows: int, parameters=None) -> Tensor:
        """`table` continued to `rows` positions by integrating onward from its last point
        (fixed-grid methods: the same grid as one solve, equal to a fresh one up to the rounding of the
        restart point, b(0) + (b(t) - b(0)); dopri5 chooses its steps
        per extension, within its tolerance of one solve)."""
        if table.size(0) >= rows:
            return table
        if table.size(0) == 0:
            return self.solve(rows, parameters)
        weights, b0 = parameters if parameters is not None else self._live_parameters()
        last = table.size(0) - 1
        states = solver.solve(self.dynamics, self.solver_options(), b0 + table[-1], last, rows - 1, weights,
                              self.cache.constant)
        return torch.cat([table, states[1:] - b0], dim=0)

    def table(self, rows: int) -> Tensor:
        """b(t_i) - b(0) for at least positions 0..rows-1 from the parameters as they are now, as
        evaluation reads it (the kept evaluation table, checked against the parameters), in either
        mode and without gradient: for plots and checks outside a forward pass, whose own tables may
        be older (a training pass's, before an optimizer step)."""
        with torch.no_grad(), self.cache.apart():
            return self.tables.evaluation_table(self, rows).values

    # --- called by the trainer, the stacks and the attention ---------------------------------------
    def set_num_updates(self, num_updates: int):
        """Each training step's update count (fairseq's task calls this before the step). The first
        call after loading a checkpoint adopts its window if the count goes on from the saved one
        (a resume); a run that counts again from 0 (--finetune-from-model, --reset-optimizer) starts
        a window of its own: the saved one was solved from parameters it no longer starts from."""
        resumable, self._resumable_window = self._resumable_window, None
        if resumable is not None:
            window, saved_updates = resumable
            if saved_updates > 0 and num_updates == saved_updates and \
                    num_updates // self.recompute_every == window.index:
                self.tables.window = window
        self._num_updates = num_updates

    def begin(self, stack, positions=None, source_positions=None, earlier=0):
        context = super().begin(stack, positions, source_positions, earlier)
        model_pass = self.cache.model_pass
        state = model_pass.get(self.pass_key)
        if state is not None and state.solved_from is not None and \
                not self.same_versions(state.solved_from, self.solve_input_versions()):
            # the decoder continuing the encoder's pass (it reads its output): the pass's tables only
            # while the tensors they were solved from stand (no optimizer step or load in between)
            state = None
        if state is None:  # a new forward pass of the model (the cache's model-pass scope)
            versions = self.solve_input_versions() if stack == "encoder" else None
            state = model_pass[self.pass_key] = PassState(versions)
            if self.training:
                self._resumable_window = None  # (trained without being told the update count)
            if self.training and self.recompute_every > 1:
                self.tables.start_window_pass(self, self._num_updates, state.tables)
        if earlier > 0:
            # a later decoding step: its pass's first step checked the table and saw the source
            # positions (cross-attention keys are cached); its own are below earlier + length,
            # known without reading them (a host sync per step costs more than FLOATER's step)
            length = positions.stop - positions.start if isinstance(positions, Positions) else positions.size(-1)
            state.needed = max(state.needed, earlier + length)
            self._fill_step_biases(positions, state)
            return context
        for stack_positions in (positions, source_positions):
            # (the stacks' positions carry their bounds: no host read)
            if stack_positions is not None and tensor_of(stack_positions).numel() > 0:
                state.needed = max(state.needed, bounds(stack_positions)[1] + 1)
        if torch.is_grad_enabled() and self._slots:
            self._prepare_biases(stack)
        return context

    def _prepare_biases(self, role: str):
        """The biases of every slot of the stack, computed before its layers run. A layer under
        activation checkpointing (layer_checkpoint.py) is recomputed during backward and must repeat
        exactly its forward's operations: with the pass's table and biases made here, every layer only
        reads them, in its forward as in its recomputation."""
        context = self.contexts[role]
        for slot_role, layer, which in self._slot_keys:
            if stack_of(slot_role) != role:
                continue
            # cross-attention: queries are the target tokens, keys and values the source tokens
            positions = context.positions if which == "q" else context.key_positions(slot_role)
            if positions is not None:
                self.projection_bias(slot_role, layer, which, positions)

    def _fill_step_biases(self, positions, state: PassState):
        """A later decoding step in inference: the target tokens' biases (decoder q/k/v, cross q) are
        one row of the group table the decode's first step used (the inference scope's step rows),
        handed to every projection of the step at once (Python work per projection is most of
        FLOATER's step): the step's positions and that row's biases per slot, which
        `projection_bias` finds with one lookup."""
        cache = self.cache
        if (self.step_ready_key not in cache.decode_values or self.training or torch.is_grad_enabled()
                or not is_shared_range(positions)):
            return
        group_table, usable, rows = cache.inference_values[self.step_rows_key]
        first, last = positions.start, positions.stop - 1
        if first == last < usable:  # beyond: the full path extends the table or names the overflow
            biases = rows.get(last)
            if biases is None:  # (each position's views made once: the next decode reads them again)
                biases = rows[last] = dict(zip(self._target_keys, group_table[last].unbind(0)))
            state.step_positions, state.step_biases = positions, biases

    def projection_bias(self, role, layer, which, positions):
        """b(t_i) = b(0) + table[i] for each token of the call, (T, B, E): the projection's bias."""
        state = self.cache.model_pass.get(self.pass_key)
        if state is None:
            state = self.pass_state()
        elif state.step_biases is not None and positions is state.step_positions:  # (`_fill_step_biases`)
            bias = state.step_biases.get((role, layer, which))
            if bias is not None:
                return bias
        hit = state.biases.get((role, layer, which))  # gathered with its group earlier in the pass
        if hit is not None and hit[0] is positions:
            return hit[1]
        slot = self._slot_index.get((role, layer, which))
        if slot is None or positions is None:
            return None
        dtype = self._slots[slot][3].q_proj.weight.dtype
        # begin() saw every position of this forward (one host sync per stack, not one per layer)
        rows = state.needed or (int(tensor_of(positions).max()) + 1 if tensor_of(positions).numel() else 1)
        solved = self.tables.table(self, rows, state.tables)
        if rows > solved.first_overflow:
            peak = float(solved.values[solved.first_overflow].abs().max())
            raise overflow_error(solved.first_overflow, peak, self.bias_limit(), rows)
        group = self._groups[(role, which)]
        biases = self._gathered(solved.values, group, positions, dtype, state)
        if self.tables.is_evaluation(self, solved.values) and group == self._groups.get(("decoder", "q")) \
                and not torch.is_grad_enabled():
            # target tokens of an inference pass: its later decoding steps read their row at once
            group_table = self._group_table(solved.values, group, dtype, state)
            kept = self.cache.inference_values  # (checked in this pass: the evaluation table is its entry)
            step_rows = kept.get(self.step_rows_key)
            if step_rows is None or step_rows[0] is not group_table:
                kept[self.step_rows_key] = (group_table, solved.first_overflow, {})
            self.cache.decode_values[self.step_ready_key] = True
        return biases[group.index(slot)]

    def _gathered(self, table: Tensor, group: tuple, positions: AnyPositions, dtype: torch.dtype,
                  state: PassState) -> tuple:
        """b(t) of the `group`'s slots at `positions`, one (T, B, d) per slot in `dtype`: gathered
        once per forward pass and shared by the layers. A `shared_range` is known by its value
        (the same range of a beam's rows, made anew per call, is found again); a tensor of arbitrary
        positions is the one the entry was made for."""
        shared = is_shared_range(positions)
        key = (group, dtype, (positions.start, positions.stop, positions.rows) if shared else None)
        hit = state.gathered.get(key)
        if hit is None or hit[0] is not table or not (shared or hit[1] is positions):
            if shared:  # every row the same positions: rows of the table, no gather
                first, last = positions.start, positions.stop - 1
                rows = self._group_table(table, group, dtype, state)[first: last + 1]
                if first == last and not torch.is_grad_enabled():  # a decoding step: the projection's own (d,) bias
                    biases = rows[0].unbind(0)
                else:  # (T, 1, d) per slot, broadcast over the batch
                    biases = rows.unsqueeze(1).unbind(2)
            else:
                biases = self._gather(self._group_table(table, group, dtype, state), tensor_of(positions))
            hit = state.gathered[key] = (table, positions, biases)
            for slot, bias in zip(group, biases):
                state.biases[self._slot_keys[slot]] = (positions, bias)
        return hit[2]

    def _group_table(self, table: Tensor, group: tuple, dtype: torch.dtype, state: PassState) -> Tensor:
        """b(t) = b(0) + table of the group's slots at every position of the table, (rows, slots, d)
        in `dtype`, with the live b(0) (also in a K-window, whose table is the window snapshot's):
        once per pass; in evaluation kept as long as the evaluation table (which is tied to b(0))."""
        if self.tables.is_evaluation(self, table):  # the inference scope, beside the evaluation table
            kept, key = self.cache.inference_values, self.term_key("model", "group table", group, dtype)
        else:
            kept, key = state.group_tables, (group, dtype)
        hit = kept.get(key)
        if hit is None or hit[0] is not table:
            hit = kept[key] = (table, self._with_initial_values(table, group, dtype))
        return hit[1]

    def _with_initial_values(self, table: Tensor, group: tuple, dtype: torch.dtype) -> Tensor:
        index = torch.tensor(group, device=table.device)
        initial = torch.stack([self._slots[slot][3].full_projection_bias(self._slots[slot][2]) for slot in group])
        # added in the solve dtype, rounded once to the model's (exactly b(0) where the table is 0)
        return (table.index_select(1, index) + initial.to(table.dtype)).to(dtype)

    @staticmethod
    def _gather(group_table: Tensor, positions: Tensor) -> tuple:
        gather = GatherSlots.apply if group_table.requires_grad and torch.is_grad_enabled() else GatherSlots.gather
        return gather(group_table, positions.t().reshape(-1), *positions.shape)

    # --- checkpoints: the window snapshot (K > 1), never a table -----------------------------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.recompute_every > 1 and self._slots:
            window = self.tables.window
            # fixed shapes (EMA and checkpoint averaging combine entries key by key); index -1: none yet
            parameters = window.parameters if window is not None else snapshot(self.solve_inputs(), self.solve_dtype())
            destination[prefix + "window_parameters"] = parameters.clone()
            destination[prefix + "window_index"] = torch.tensor(
                float(window.index) if window is not None else -1.0, dtype=torch.float64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        ours = [prefix + name for name in ("window_parameters", "window_index", "cache")]  # cache: older versions
        for key in ours:
            if key in unexpected_keys:
                unexpected_keys.remove(key)
        self._loaded_window = (state_dict.get(ours[0]), state_dict.get(ours[1]))

    @staticmethod
    def _after_load(module, incompatible_keys):
        """After the whole model is loaded: forget every table; keep the saved window for an exact
        resume, adopted by `set_num_updates` only where training goes on from the saved update."""
        parameters, index = getattr(module, "_loaded_window", (None, None))
        module._loaded_window = (None, None)
        module._forget_tables()
        expected = sum(p.numel() for p in module.solve_inputs())
        if (module.recompute_every > 1 and parameters is not None and index is not None
                and parameters.numel() == expected and float(index) >= 0 and float(index) == int(float(index))):
            device = module.dynamics.fc1.weight.device
            window = Window(int(float(index)), module.table_options(),
                            parameters.to(device=device, dtype=module.solve_dtype()))
            # fairseq's trainer sets the checkpoint's update count on the model before loading it
            module._resumable_window = (window, module._num_updates)
