#include "tidal/common/optimizer_schedule.hpp"

#include "tidal/common/enum_names.hpp"

namespace tidal {

TIDAL_ENUM_NAMES(OptimizerSchedule, optimizer_schedule_from_string, "optimizer schedule",
                 {OptimizerSchedule::kAfterBackward, "after-backward"},
                 {OptimizerSchedule::kInBackward, "in-backward"},
                 {OptimizerSchedule::kDeferred, "deferred"})

}  // namespace tidal
